//! Request batching: requests into micro-batches balanced by tokens, admitted only when
//! their KV cache fits (MoE-Lightning Alg. 2), and the KV block size for a micro-batch.
//!
//! Takes prompt lengths, the generation length and each micro-batch's capacities; gives,
//! per micro-batch, the requests it runs. Longest prompts are placed first, each on the
//! micro-batch with the fewest tokens that still has a sequence slot, token room and KV
//! room; what fits nowhere waits for a later batch. Pure functions, no state.

/// What one micro-batch can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UbCapacity {
    /// Sequences it may hold at most.
    pub seqs: usize,
    /// New tokens in one step (prompt tokens during prefill).
    pub tokens: usize,
    /// Tokens its KV cache slices hold (all its sequences together).
    pub kv_tokens: usize,
}

/// Tokens per KV block: the largest of 16, 8, 4, 2, 1 for which `budgets` (tokens each
/// sequence will reach) fit in `kv_tokens`; `None` if even 1 does not.
pub fn block_size(kv_tokens: usize, budgets: &[usize]) -> Option<usize> {
    [16, 8, 4, 2, 1].into_iter().find(|&b| {
        let needed: usize = budgets.iter().map(|t| t.div_ceil(b)).sum();
        needed <= kv_tokens / b
    })
}

/// One batch: requests per micro-batch (indices into `prompt_lens`), and the requests left.
pub fn admit(
    prompt_lens: &[usize],
    waiting: &[usize],
    gen_len: usize,
    capacities: &[UbCapacity],
) -> (Vec<Vec<usize>>, Vec<usize>) {
    let mut order: Vec<usize> = waiting.to_vec();
    order.sort_by_key(|&r| (std::cmp::Reverse(prompt_lens[r]), r));
    let mut ubs: Vec<Vec<usize>> = vec![Vec::new(); capacities.len()];
    let mut tokens = vec![0usize; capacities.len()];
    let mut left = Vec::new();
    for r in order {
        let len = prompt_lens[r];
        let fits = |u: usize| {
            let cap = capacities[u];
            if ubs[u].len() >= cap.seqs || tokens[u] + len > cap.tokens {
                return false;
            }
            let mut budgets: Vec<usize> =
                ubs[u].iter().map(|&q| prompt_lens[q] + gen_len).collect();
            budgets.push(len + gen_len);
            block_size(cap.kv_tokens, &budgets).is_some()
        };
        match (0..capacities.len())
            .filter(|&u| fits(u))
            .min_by_key(|&u| (tokens[u], u))
        {
            Some(u) => {
                ubs[u].push(r);
                tokens[u] += len;
            }
            None => left.push(r),
        }
    }
    for ub in &mut ubs {
        ub.sort_unstable();
    }
    left.sort_unstable();
    (ubs, left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balances_tokens_longest_first() {
        let lens = [10, 3, 7, 2, 8];
        let cap = UbCapacity {
            seqs: 3,
            tokens: 100,
            kv_tokens: 1000,
        };
        let (ubs, left) = admit(&lens, &[0, 1, 2, 3, 4], 4, &[cap, cap]);
        // 10 -> ub0, 8 -> ub1, 7 -> ub1 (8 < 10), 3 -> ub0 (10 < 15), 2 -> ub0 (13 < 15).
        assert_eq!(ubs, vec![vec![0, 1, 3], vec![2, 4]]);
        assert!(left.is_empty());
    }

    #[test]
    fn kv_capacity_defers_requests() {
        let lens = [30, 30, 30];
        let cap = UbCapacity {
            seqs: 4,
            tokens: 1000,
            kv_tokens: 64,
        };
        let (ubs, left) = admit(&lens, &[0, 1, 2], 2, &[cap]);
        // 32 tokens each: two fit in 64 slots with 16-token blocks; the third waits.
        assert_eq!(ubs, vec![vec![0, 1]]);
        assert_eq!(left, vec![2]);
    }

    #[test]
    fn block_size_shrinks_to_fit() {
        assert_eq!(block_size(40, &[20, 20]), Some(4));
        assert_eq!(block_size(64, &[16, 16, 16, 16]), Some(16));
        assert_eq!(block_size(3, &[2, 2]), None);
    }
}
