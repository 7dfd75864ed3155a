//! MoE-Lens' resource-aware scheduler (§6.2) for plans with one mixed `step` (VSLPipe):
//! KV blocks are given out as sequences grow, not reserved for the whole generation.
//!
//! Before every pass the decode scheduler gives each decoding sequence the block its next
//! token needs. When a micro-batch's pool runs short it enters preemption mode: the
//! youngest decoding sequences are preempted (their blocks freed; they go back to the
//! head of the queue with the tokens they generated, to be prefilled again) until the
//! older ones fit. A sequence whose re-prefill would not fit any micro-batch's token cap
//! is paused instead (it keeps its blocks and skips this pass). Then the prefill scheduler
//! admits waiting sequences from the head of the queue (first come, first served, so the
//! preempted come back first) while a micro-batch has a sequence slot, token room and free
//! blocks for the prompt and its first generated token. Pure bookkeeping: no kernels, no
//! threads; the driver in `runtime` executes what this decides.

use super::batching::UbCapacity;
use std::collections::VecDeque;

/// A sequence holding KV blocks in a micro-batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seq {
    /// The request (prompt index) it answers.
    pub request: usize,
    /// Its micro-batch.
    pub ub: usize,
    /// Its blocks in the micro-batch's KV slices, in token order.
    pub block_table: Vec<u32>,
    /// Tokens generated so far (kept across a preemption).
    pub generated: Vec<u32>,
    /// False until its (re-)prefill has run.
    pub prompt_done: bool,
    /// Admission order (larger = younger); preemption takes the youngest first.
    pub age: u64,
    /// Skipped by this pass (paused for lack of blocks).
    pub paused: bool,
}

impl Seq {
    /// Tokens this pass runs: the prompt and what was generated before a preemption, or
    /// the last generated token.
    pub fn new_tokens(&self, prompt: &[u32]) -> Vec<u32> {
        if self.prompt_done {
            vec![*self.generated.last().unwrap_or(&0)]
        } else {
            let mut tokens = prompt.to_vec();
            tokens.extend_from_slice(&self.generated);
            tokens
        }
    }

    /// Tokens in its KV cache before this pass.
    pub fn context_len(&self, prompt_len: usize) -> usize {
        if self.prompt_done {
            prompt_len + self.generated.len() - 1
        } else {
            0
        }
    }
}

/// A request waiting for admission (fresh, or preempted with its generated tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The request.
    pub request: usize,
    /// Tokens it generated before being preempted (empty when fresh).
    pub generated: Vec<u32>,
}

/// One micro-batch's KV block pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPool {
    /// Tokens per block (fixed for the run).
    pub block_size: usize,
    /// Free block ids; the next taken is the last.
    pub free: Vec<u32>,
    /// Blocks in the pool.
    pub total: usize,
}

impl KvPool {
    /// A pool of `kv_tokens / block_size` blocks, all free, handed out in id order.
    pub fn new(kv_tokens: usize, block_size: usize) -> Self {
        let b = block_size.max(1);
        KvPool {
            block_size: b,
            free: (0..(kv_tokens / b) as u32).rev().collect(),
            total: kv_tokens / b,
        }
    }

    /// Blocks needed to hold `tokens`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Takes `n` blocks, or none if fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        let at = self.free.len().checked_sub(n)?;
        let mut blocks = self.free.split_off(at);
        blocks.reverse();
        Some(blocks)
    }

    /// Returns blocks to the pool.
    pub fn give(&mut self, blocks: &mut Vec<u32>) {
        self.free.extend(blocks.drain(..).rev());
    }
}

/// What the decode scheduler did before a pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodePlan {
    /// Sequences preempted this pass, oldest first (to go back to the head of the queue).
    pub preempted: Vec<Pending>,
    /// Sequences paused this pass.
    pub paused: usize,
}

/// Gives every decoding sequence the blocks its next token needs; where a pool is short,
/// preempts (or pauses) the youngest decoding sequences of that micro-batch until the rest
/// fit. `max_prefill` is the largest re-prefill a micro-batch can take in one pass.
/// Preempted sequences are removed from `running`.
pub fn grow_decoding(
    running: &mut Vec<Seq>,
    pools: &mut [KvPool],
    prompt_lens: &[usize],
    max_prefill: usize,
) -> DecodePlan {
    let mut plan = DecodePlan::default();
    for s in running.iter_mut() {
        s.paused = false;
    }
    for (u, pool) in pools.iter_mut().enumerate() {
        let need = |s: &Seq, pool: &KvPool| {
            let tokens = prompt_lens[s.request] + s.generated.len();
            pool.blocks_for(tokens).saturating_sub(s.block_table.len())
        };
        // Youngest first: the order preemption takes them in.
        let mut order: Vec<usize> = (0..running.len())
            .filter(|&i| running[i].ub == u && running[i].prompt_done)
            .collect();
        order.sort_by_key(|&i| std::cmp::Reverse(running[i].age));
        let mut demand: usize = order.iter().map(|&i| need(&running[i], pool)).sum();
        let mut victims = Vec::new();
        for &i in &order {
            if demand <= pool.free.len() {
                break;
            }
            let s = &mut running[i];
            demand -= need(s, pool);
            if prompt_lens[s.request] + s.generated.len() <= max_prefill {
                pool.give(&mut s.block_table);
                victims.push(i);
            } else {
                s.paused = true;
                plan.paused += 1;
            }
        }
        for &i in order.iter().rev() {
            let s = &mut running[i];
            if s.paused || victims.contains(&i) {
                continue;
            }
            let n = need(s, pool);
            if let Some(mut blocks) = pool.take(n) {
                s.block_table.append(&mut blocks);
            } else {
                // Unreachable by the demand count above; pausing keeps the run correct.
                s.paused = true;
                plan.paused += 1;
            }
        }
        victims.sort_by_key(|&i| running[i].age);
        for &i in &victims {
            let s = &running[i];
            plan.preempted.push(Pending {
                request: s.request,
                generated: s.generated.clone(),
            });
        }
        let mut index = 0;
        running.retain(|_| {
            let keep = !victims.contains(&index);
            index += 1;
            keep
        });
    }
    plan
}

/// Admits waiting sequences from the head of `waiting` (first come, first served; stops at
/// the first that fits nowhere) onto the micro-batch with the fewest tokens this pass that
/// has a sequence slot, token room, free blocks for its tokens plus the first generated
/// one, and a pool that can hold it to the end of its generation (`gen_len` tokens
/// generated in all), so a lone sequence always finishes. Returns the number admitted.
pub fn admit_fifo(
    waiting: &mut VecDeque<Pending>,
    running: &mut Vec<Seq>,
    pools: &mut [KvPool],
    caps: &[UbCapacity],
    prompt_lens: &[usize],
    gen_len: usize,
    next_age: &mut u64,
) -> usize {
    let n = caps.len().min(pools.len());
    let mut seqs = vec![0usize; n];
    let mut tokens = vec![0usize; n];
    for s in running.iter() {
        if s.ub < n {
            seqs[s.ub] += 1;
            if !s.paused {
                tokens[s.ub] += if s.prompt_done {
                    1
                } else {
                    prompt_lens[s.request] + s.generated.len()
                };
            }
        }
    }
    let mut admitted = 0;
    while let Some(head) = waiting.front() {
        let len = prompt_lens[head.request] + head.generated.len();
        let fits = |u: usize| {
            seqs[u] < caps[u].seqs
                && tokens[u] + len <= caps[u].tokens
                && pools[u].blocks_for(len + 1) <= pools[u].free.len()
                && pools[u].blocks_for(prompt_lens[head.request] + gen_len) <= pools[u].total
        };
        let Some(u) = (0..n).filter(|&u| fits(u)).min_by_key(|&u| (tokens[u], u)) else {
            break;
        };
        let Some(head) = waiting.pop_front() else {
            break;
        };
        let Some(block_table) = pools[u].take(pools[u].blocks_for(len)) else {
            waiting.push_front(head);
            break;
        };
        seqs[u] += 1;
        tokens[u] += len;
        running.push(Seq {
            request: head.request,
            ub: u,
            block_table,
            generated: head.generated,
            prompt_done: false,
            age: *next_age,
            paused: false,
        });
        *next_age += 1;
        admitted += 1;
    }
    admitted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoding(request: usize, ub: usize, blocks: Vec<u32>, generated: usize, age: u64) -> Seq {
        Seq {
            request,
            ub,
            block_table: blocks,
            generated: vec![7; generated],
            prompt_done: true,
            age,
            paused: false,
        }
    }

    /// Two sequences of 4 prompt tokens in blocks of 4 tokens, 3 blocks in the pool: both
    /// hold one block and have generated one token (5th token ahead, a new block each).
    /// Only one block is free, so the younger is preempted, its block freed, and the older
    /// gets the block it needs.
    #[test]
    fn youngest_decoding_sequence_is_preempted_when_blocks_run_out() {
        let mut pools = vec![KvPool::new(12, 4)];
        let a = pools[0].take(1).unwrap();
        let b = pools[0].take(1).unwrap();
        assert_eq!(pools[0].free.len(), 1);
        let mut running = vec![decoding(0, 0, a, 1, 0), decoding(1, 0, b, 1, 1)];
        // One free block, but each needs one more -> demand 2 > 1: preempt the younger.
        let plan = grow_decoding(&mut running, &mut pools, &[4, 4], 100);
        assert_eq!(
            plan.preempted,
            vec![Pending {
                request: 1,
                generated: vec![7]
            }]
        );
        assert_eq!(running.len(), 1);
        assert_eq!(running[0].request, 0);
        assert_eq!(running[0].block_table.len(), 2);
        // The victim's block went back and one of the two free blocks went to request 0.
        assert_eq!(pools[0].free.len(), 1);
    }

    /// With room for everyone, nobody is preempted and each gets exactly its blocks.
    #[test]
    fn enough_blocks_means_no_preemption() {
        let mut pools = vec![KvPool::new(64, 4)];
        let a = pools[0].take(1).unwrap();
        let b = pools[0].take(2).unwrap();
        let mut running = vec![decoding(0, 0, a, 1, 0), decoding(1, 0, b, 2, 1)];
        // Request 0: 4 + 1 = 5 tokens -> 2 blocks (1 more); request 1: 6 + 2 = 8 -> 2 (0 more).
        let plan = grow_decoding(&mut running, &mut pools, &[4, 6], 100);
        assert!(plan.preempted.is_empty());
        assert_eq!(plan.paused, 0);
        assert_eq!(running[0].block_table.len(), 2);
        assert_eq!(running[1].block_table.len(), 2);
        assert_eq!(pools[0].free.len(), 16 - 4);
    }

    /// A victim whose re-prefill exceeds every token cap is paused, not preempted.
    #[test]
    fn too_long_to_reprefill_means_paused() {
        let mut pools = vec![KvPool::new(8, 4)];
        let a = pools[0].take(1).unwrap();
        let b = pools[0].take(1).unwrap();
        let mut running = vec![decoding(0, 0, a, 1, 0), decoding(1, 0, b, 1, 1)];
        let plan = grow_decoding(&mut running, &mut pools, &[4, 4], 4);
        assert!(plan.preempted.is_empty());
        assert_eq!(plan.paused, 2);
        assert!(running.iter().all(|s| s.paused));
    }

    /// FIFO: the preempted sequence at the head goes first; a later one that does not fit
    /// stops admission even if a still later one would fit.
    #[test]
    fn admission_is_first_come_first_served_under_blocks_and_token_cap() {
        let mut pools = vec![KvPool::new(16, 4)];
        let caps = [UbCapacity {
            seqs: 4,
            tokens: 20,
            kv_tokens: 16,
        }];
        let lens = [3, 10, 2];
        let mut waiting: VecDeque<Pending> = VecDeque::from(vec![
            Pending {
                request: 0,
                generated: vec![5, 6],
            },
            Pending {
                request: 1,
                generated: vec![],
            },
            Pending {
                request: 2,
                generated: vec![],
            },
        ]);
        let mut running = Vec::new();
        let mut age = 0;
        let n = admit_fifo(
            &mut waiting,
            &mut running,
            &mut pools,
            &caps,
            &lens,
            4,
            &mut age,
        );
        // Request 0 re-prefills 5 tokens: 2 blocks (room for 6) -> 2 blocks taken, 2 left.
        // Request 1 needs blocks for 11 tokens = 3 > 2 free: admission stops there.
        assert_eq!(n, 1);
        assert_eq!(running[0].block_table.len(), 2);
        assert_eq!(running[0].new_tokens(&[1, 2, 3]), vec![1, 2, 3, 5, 6]);
        assert_eq!(waiting.front().map(|p| p.request), Some(1));
    }
}
