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
//!
//! A pool may keep a prefix cache (serving sessions whose prefill attends the same KV
//! cache as their decode): a full block whose tokens have been run is registered under
//! the hash of every token up to its end, blocks are reference-counted, and a block no
//! sequence holds stays cached (evicted least recently used when a block is needed) so a
//! later sequence starting with the same tokens takes it instead of running them again.
//! A cached block is never written: a sequence writes only positions past what it took
//! from the cache, which lie in its own blocks.

use super::batching::UbCapacity;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};

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
    /// Skipped by this pass (paused for lack of blocks, or, with chunked prefill, of token
    /// room in the pass).
    pub paused: bool,
    /// Tokens its (re-)prefill takes from the prefix cache (whole blocks at the start of
    /// its table), so they are not run again; 0 without a cache hit.
    pub cached: usize,
}

impl Seq {
    /// Tokens this pass runs: the prompt and what was generated before a preemption (past
    /// what came from the prefix cache), or the last generated token.
    pub fn new_tokens(&self, prompt: &[u32]) -> Vec<u32> {
        if self.prompt_done {
            vec![*self.generated.last().unwrap_or(&0)]
        } else {
            let mut tokens: Vec<u32> = prompt.iter().skip(self.cached).copied().collect();
            let skip_generated = self.cached.saturating_sub(prompt.len());
            tokens.extend(self.generated.iter().skip(skip_generated));
            tokens
        }
    }

    /// Tokens in its KV cache before this pass.
    pub fn context_len(&self, prompt_len: usize) -> usize {
        if self.prompt_done {
            prompt_len + self.generated.len() - 1
        } else {
            self.cached
        }
    }

    /// Tokens whose KV this sequence's cache holds after its last pass: its prompt and
    /// every generated token but the last (sampled, not yet run); none before its prefill.
    pub fn written(&self, prompt: &[u32]) -> Vec<u32> {
        if !self.prompt_done {
            return Vec::new();
        }
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(&self.generated[..self.generated.len().saturating_sub(1)]);
        tokens
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
    /// Free block ids that hold nothing cached; the next taken is the last.
    pub free: Vec<u32>,
    /// Blocks in the pool.
    pub total: usize,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// The prefix cache, where the pool keeps one.
    cache: Option<PrefixCache>,
}

/// Full blocks by the hash of their tokens and every token before them (see the module
/// header).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PrefixCache {
    /// Chain hash -> block.
    by_hash: HashMap<u64, u32>,
    /// Per block: what it caches, if anything.
    entries: Vec<Option<CacheEntry>>,
    /// Cached blocks no sequence holds, by last use (oldest first): evicted in this order.
    idle: BTreeMap<u64, u32>,
    /// Use counter.
    clock: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct CacheEntry {
    hash: u64,
    /// The block before it in the prefix (`None` for a first block).
    parent: Option<u32>,
    /// Its tokens (compared on a hit, so a hash collision is a miss, never wrong KV).
    tokens: Vec<u32>,
    /// Its key in `idle` while no sequence holds it.
    last_use: u64,
}

/// The hash of a block's tokens chained to the hash of the prefix before it.
fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    // `DefaultHasher::new` has fixed keys: the same tokens hash alike in every process.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl KvPool {
    /// A pool of `kv_tokens / block_size` blocks, all free, handed out in id order.
    pub fn new(kv_tokens: usize, block_size: usize) -> Self {
        let b = block_size.max(1);
        let total = kv_tokens / b;
        KvPool {
            block_size: b,
            free: (0..total as u32).rev().collect(),
            total,
            refs: vec![0; total],
            cache: None,
        }
    }

    /// The same pool with a prefix cache.
    pub fn with_prefix_cache(mut self) -> Self {
        self.cache = Some(PrefixCache {
            entries: vec![None; self.total],
            ..PrefixCache::default()
        });
        self
    }

    /// Blocks needed to hold `tokens`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks a sequence can be given now: free ones and cached ones nobody holds.
    pub fn available(&self) -> usize {
        self.free.len() + self.cache.as_ref().map_or(0, |c| c.idle.len())
    }

    /// Cached blocks no sequence holds (kept for a later hit, given when needed).
    pub fn idle_cached(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.idle.len())
    }

    /// Takes `n` blocks (free ones first, then the least recently used idle cached ones,
    /// which leave the cache), or none if fewer are available.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.available() {
            return None;
        }
        let from_free = n.min(self.free.len());
        let at = self.free.len() - from_free;
        let mut blocks = self.free.split_off(at);
        blocks.reverse();
        while blocks.len() < n {
            let cache = self.cache.as_mut()?;
            let (_, block) = cache.idle.pop_first()?;
            if let Some(entry) = cache.entries.get_mut(block as usize).and_then(Option::take) {
                cache.by_hash.remove(&entry.hash);
            }
            blocks.push(block);
        }
        for &b in &blocks {
            if let Some(r) = self.refs.get_mut(b as usize) {
                *r = 1;
            }
        }
        Some(blocks)
    }

    /// Returns blocks to the pool: one holder fewer each; a block nobody holds is free
    /// again, or idle in the cache if it caches a prefix.
    pub fn give(&mut self, blocks: &mut Vec<u32>) {
        for b in blocks.drain(..).rev() {
            let Some(r) = self.refs.get_mut(b as usize) else {
                continue;
            };
            *r = r.saturating_sub(1);
            if *r > 0 {
                continue;
            }
            match self.cache.as_mut() {
                Some(cache) if cache.entries.get(b as usize).is_some_and(Option::is_some) => {
                    cache.clock += 1;
                    let tick = cache.clock;
                    if let Some(Some(entry)) = cache.entries.get_mut(b as usize) {
                        entry.last_use = tick;
                    }
                    cache.idle.insert(tick, b);
                }
                _ => self.free.push(b),
            }
        }
    }

    /// The cached blocks that hold the longest prefix of `tokens` in whole blocks, leaving
    /// at least one token to run (its logits give the next token); empty without a cache.
    pub fn lookup(&self, tokens: &[u32]) -> Vec<u32> {
        let Some(cache) = &self.cache else {
            return Vec::new();
        };
        let bs = self.block_size;
        let whole = tokens.len().saturating_sub(1) / bs;
        let mut found = Vec::new();
        let (mut hash, mut parent) = (0u64, None);
        for chunk in tokens.chunks(bs).take(whole) {
            hash = chain_hash(hash, chunk);
            let Some(&block) = cache.by_hash.get(&hash) else {
                break;
            };
            let hit = cache
                .entries
                .get(block as usize)
                .and_then(Option::as_ref)
                .is_some_and(|e| e.parent == parent && e.tokens == chunk);
            if !hit {
                break;
            }
            found.push(block);
            parent = Some(block);
        }
        found
    }

    /// One more holder for each of `blocks` (from [`KvPool::lookup`]); an idle one is
    /// no longer evictable.
    pub fn share(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let Some(r) = self.refs.get_mut(b as usize) else {
                continue;
            };
            if *r == 0 {
                if let Some(cache) = self.cache.as_mut() {
                    if let Some(Some(entry)) = cache.entries.get(b as usize) {
                        cache.idle.remove(&entry.last_use);
                    }
                }
            }
            *r += 1;
        }
    }

    /// Registers the whole blocks of `table` that hold `tokens` (the tokens whose KV the
    /// sequence has written, from position 0) so later sequences can take them. A block
    /// already cached, or whose prefix another block already caches, is left as it is.
    pub fn register(&mut self, tokens: &[u32], table: &[u32]) {
        let bs = self.block_size;
        let Some(cache) = self.cache.as_mut() else {
            return;
        };
        let (mut hash, mut parent) = (0u64, None);
        for (chunk, &block) in tokens.chunks_exact(bs).zip(table) {
            hash = chain_hash(hash, chunk);
            let Some(slot) = cache.entries.get_mut(block as usize) else {
                return;
            };
            match (&*slot, cache.by_hash.get(&hash)) {
                // This block already caches this prefix (it was taken from the cache).
                (Some(e), _) if e.hash == hash => {}
                // Another block caches it (both ran the same tokens at once): the chain
                // goes on through that one, this block stays uncached.
                (_, Some(&other)) => {
                    parent = Some(other);
                    continue;
                }
                (Some(_), None) => return,
                (None, None) => {
                    *slot = Some(CacheEntry {
                        hash,
                        parent,
                        tokens: chunk.to_vec(),
                        last_use: 0,
                    });
                    cache.by_hash.insert(hash, block);
                }
            }
            parent = Some(block);
        }
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
            if demand <= pool.available() {
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

/// What [`admit_fifo`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admitted {
    /// Sequences admitted.
    pub sequences: usize,
    /// Of them, those that took blocks from the prefix cache.
    pub prefix_hits: usize,
    /// Tokens they took from the prefix cache (not run again).
    pub cached_tokens: usize,
    /// Tokens of every admitted sequence (prompt and re-prefilled generated tokens).
    pub tokens: usize,
}

/// Admits waiting sequences from the head of `waiting` (first come, first served; stops at
/// the first that fits nowhere) onto the micro-batch with the most of its prefix cached,
/// then the fewest tokens this pass, that has a sequence slot, token room for what it
/// runs, blocks for its tokens plus the first generated one, and a pool that can hold it
/// to the end of its generation (`finish_lens[r]` tokens, its prompt and every token it
/// may generate), so a lone sequence always finishes. With `worst_case`, the pool must
/// hold every sequence of the micro-batch to its end at once (blocks are still given as
/// they grow): a static batch, which cannot take a preempted sequence back until it ends,
/// then never runs out. With `chunked` a sequence whose prompt is longer than the room
/// left is admitted while any room is left (its prefill runs in chunks, see
/// `Session::on_demand_kv`). `prompts[r]` is request `r`'s prompt.
#[allow(clippy::too_many_arguments)]
pub fn admit_fifo(
    waiting: &mut VecDeque<Pending>,
    running: &mut Vec<Seq>,
    pools: &mut [KvPool],
    caps: &[UbCapacity],
    prompts: &[&[u32]],
    finish_lens: &[usize],
    worst_case: bool,
    chunked: bool,
    next_age: &mut u64,
) -> Admitted {
    let n = caps.len().min(pools.len());
    let mut seqs = vec![0usize; n];
    let mut tokens = vec![0usize; n];
    // Blocks every sequence of a micro-batch needs at its end (for `worst_case`).
    let mut at_end = vec![0usize; n];
    let prompt_len = |r: usize| prompts.get(r).map_or(0, |p| p.len());
    for s in running.iter() {
        if s.ub < n {
            seqs[s.ub] += 1;
            at_end[s.ub] +=
                pools[s.ub].blocks_for(finish_lens.get(s.request).copied().unwrap_or(0));
            if !s.paused {
                let run = if s.prompt_done {
                    1
                } else {
                    (prompt_len(s.request) + s.generated.len()).saturating_sub(s.cached)
                };
                tokens[s.ub] += if chunked {
                    run.min(caps[s.ub].tokens.saturating_sub(tokens[s.ub]))
                } else {
                    run
                };
            }
        }
    }
    let mut done = Admitted::default();
    while let Some(head) = waiting.front() {
        let mut all: Vec<u32> = prompts.get(head.request).copied().unwrap_or(&[]).to_vec();
        all.extend_from_slice(&head.generated);
        let len = all.len();
        let finish = finish_lens.get(head.request).copied().unwrap_or(len);
        let candidates: Vec<(usize, Vec<u32>)> = (0..n)
            .filter_map(|u| {
                let pool = &pools[u];
                let hits = pool.lookup(&all);
                let cached = hits.len() * pool.block_size;
                let idle_hits = hits.iter().filter(|&&b| pool.refs[b as usize] == 0).count();
                let fresh = pool.blocks_for(len + 1).saturating_sub(hits.len());
                let room = caps[u].tokens.saturating_sub(tokens[u]);
                let fits = seqs[u] < caps[u].seqs
                    && (tokens[u] + (len - cached) <= caps[u].tokens || (chunked && room > 0))
                    && fresh + idle_hits <= pool.available()
                    && pool.blocks_for(finish.max(len + 1)) <= pool.total
                    && (!worst_case
                        || at_end[u] + pool.blocks_for(finish.max(len + 1)) <= pool.total);
                fits.then_some((u, hits))
            })
            .collect();
        let Some((u, hits)) = candidates
            .into_iter()
            .min_by_key(|(u, hits)| (std::cmp::Reverse(hits.len()), tokens[*u], *u))
        else {
            break;
        };
        let Some(head) = waiting.pop_front() else {
            break;
        };
        let pool = &mut pools[u];
        pool.share(&hits);
        let Some(fresh) = pool.take(pool.blocks_for(len).saturating_sub(hits.len())) else {
            let mut hits = hits;
            pool.give(&mut hits);
            waiting.push_front(head);
            break;
        };
        let cached = hits.len() * pool.block_size;
        let mut block_table = hits;
        block_table.extend(fresh);
        seqs[u] += 1;
        tokens[u] += (len - cached).min(caps[u].tokens.saturating_sub(tokens[u]));
        at_end[u] += pool.blocks_for(finish.max(len + 1));
        done.sequences += 1;
        done.tokens += len;
        done.cached_tokens += cached;
        done.prefix_hits += usize::from(cached > 0);
        running.push(Seq {
            request: head.request,
            ub: u,
            block_table,
            generated: head.generated,
            prompt_done: false,
            age: *next_age,
            paused: false,
            cached,
        });
        *next_age += 1;
    }
    done
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
            cached: 0,
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
        let prompts: [&[u32]; 3] = [&[1, 2, 3], &[9; 10], &[4, 4]];
        let finish = [3 + 4, 10 + 4, 2 + 4];
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
            &prompts,
            &finish,
            false,
            false,
            &mut age,
        )
        .sequences;
        // Request 0 re-prefills 5 tokens: 2 blocks (room for 6) -> 2 blocks taken, 2 left.
        // Request 1 needs blocks for 11 tokens = 3 > 2 free: admission stops there.
        assert_eq!(n, 1);
        assert_eq!(running[0].block_table.len(), 2);
        assert_eq!(running[0].new_tokens(&[1, 2, 3]), vec![1, 2, 3, 5, 6]);
        assert_eq!(waiting.front().map(|p| p.request), Some(1));
    }

    /// A sequence of 10 tokens in blocks of 4 registers its two whole blocks; once it has
    /// ended they stay cached (idle, still available), a second sequence with the same
    /// first 9 tokens takes both (the last token is always run), one sharing only the first
    /// block takes one, and one with a different first token takes none.
    #[test]
    fn whole_blocks_are_reused_by_prefix_and_evicted_least_recently_used() {
        let mut pool = KvPool::new(16, 4).with_prefix_cache();
        let tokens: Vec<u32> = (1..=10).collect();
        let mut table = pool.take(3).unwrap();
        pool.register(&tokens, &table);
        let first_two = table[..2].to_vec();
        pool.give(&mut table);
        assert_eq!(pool.available(), 4);
        assert_eq!(pool.idle_cached(), 2);
        assert_eq!(pool.lookup(&tokens[..9]), first_two);
        // 8 tokens: the second block would leave nothing to run.
        assert_eq!(pool.lookup(&tokens[..8]), first_two[..1].to_vec());
        assert_eq!(
            pool.lookup(&[1, 2, 3, 4, 9, 9, 9, 9, 9]),
            first_two[..1].to_vec()
        );
        assert!(pool.lookup(&[0, 2, 3, 4, 5, 6, 7, 8, 9]).is_empty());
        // A holder keeps a block from eviction; idle ones go oldest first.
        let hit = pool.lookup(&tokens[..9]);
        pool.share(&hit[..1]);
        assert_eq!(pool.idle_cached(), 1);
        let fresh = pool.take(3).unwrap();
        assert!(!fresh.contains(&hit[0]));
        assert!(
            fresh.contains(&hit[1]),
            "the idle cached block is evicted for room"
        );
        assert_eq!(pool.lookup(&tokens[..9]), hit[..1].to_vec());
        assert!(pool.take(1).is_none());
    }

    /// Two sequences that ran the same prompt at once: the first registers its blocks, the
    /// second's copies stay uncached and return to the free list.
    #[test]
    fn the_same_prefix_registered_twice_is_cached_once() {
        let mut pool = KvPool::new(16, 4).with_prefix_cache();
        let tokens: Vec<u32> = (1..=9).collect();
        let mut a = pool.take(3).unwrap();
        let mut b = pool.take(1).unwrap();
        pool.register(&tokens, &a);
        pool.register(&tokens[..4], &b);
        pool.give(&mut b);
        assert_eq!(pool.free.len(), 1);
        pool.give(&mut a);
        assert_eq!(pool.idle_cached(), 2);
        assert_eq!(pool.available(), 4);
    }

    /// Admission takes the cached blocks and runs only the rest of the prompt.
    #[test]
    fn admission_takes_the_cached_prefix() {
        let mut pools = vec![KvPool::new(32, 4).with_prefix_cache()];
        let prompt: Vec<u32> = (1..=10).collect();
        let mut first = pools[0].take(3).unwrap();
        pools[0].register(&prompt, &first);
        pools[0].give(&mut first);
        let caps = [UbCapacity {
            seqs: 2,
            tokens: 64,
            kv_tokens: 32,
        }];
        let mut waiting = VecDeque::from(vec![Pending {
            request: 0,
            generated: vec![],
        }]);
        let (mut running, mut age) = (Vec::new(), 0);
        let done = admit_fifo(
            &mut waiting,
            &mut running,
            &mut pools,
            &caps,
            &[&prompt],
            &[14],
            false,
            false,
            &mut age,
        );
        assert_eq!(done.prefix_hits, 1);
        assert_eq!(done.cached_tokens, 8);
        assert_eq!(running[0].cached, 8);
        assert_eq!(running[0].context_len(10), 8);
        assert_eq!(running[0].new_tokens(&prompt), vec![9, 10]);
        assert_eq!(running[0].block_table.len(), 3);
    }

    /// Two sequences of 4 prompt tokens that may reach 12 tokens (3 blocks of 4) in a pool
    /// of 5 blocks: by free blocks both start (a block each); holding every sequence to its
    /// end (`worst_case`, static batches) only the first does.
    #[test]
    fn worst_case_admission_holds_every_sequence_to_its_end() {
        let caps = [UbCapacity {
            seqs: 4,
            tokens: 64,
            kv_tokens: 20,
        }];
        let prompts: [&[u32]; 2] = [&[1, 2, 3, 4], &[5, 6, 7, 8]];
        for (worst_case, admitted) in [(false, 2), (true, 1)] {
            let mut pools = vec![KvPool::new(20, 4)];
            let mut waiting: VecDeque<Pending> = (0..2)
                .map(|request| Pending {
                    request,
                    generated: vec![],
                })
                .collect();
            let (mut running, mut age) = (Vec::new(), 0);
            let done = admit_fifo(
                &mut waiting,
                &mut running,
                &mut pools,
                &caps,
                &prompts,
                &[12, 12],
                worst_case,
                false,
                &mut age,
            );
            assert_eq!(done.sequences, admitted, "worst_case {worst_case}");
        }
    }

    /// A pass of 6 tokens and prompts of 4 and 10 tokens: without chunked prefill the
    /// second waits (10 > the 2 left, and > 6 alone); with it, it is admitted while any
    /// room is left, its blocks taken for the whole prompt, and a third waits only when no
    /// room is left.
    #[test]
    fn chunked_admission_takes_a_prompt_longer_than_the_room_left() {
        let caps = [UbCapacity {
            seqs: 4,
            tokens: 6,
            kv_tokens: 64,
        }];
        let prompts: [&[u32]; 3] = [&[1, 2, 3, 4], &[5; 10], &[6, 7]];
        for (chunked, admitted) in [(false, 1), (true, 2)] {
            let mut pools = vec![KvPool::new(64, 4)];
            let mut waiting: VecDeque<Pending> = (0..3)
                .map(|request| Pending {
                    request,
                    generated: vec![],
                })
                .collect();
            let (mut running, mut age) = (Vec::new(), 0);
            let done = admit_fifo(
                &mut waiting,
                &mut running,
                &mut pools,
                &caps,
                &prompts,
                &[6, 12, 4],
                false,
                chunked,
                &mut age,
            );
            assert_eq!(done.sequences, admitted, "chunked {chunked}");
            if chunked {
                assert_eq!(running[1].block_table.len(), 3, "blocks for 10 tokens + 1");
            }
        }
    }
}
