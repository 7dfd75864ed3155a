// Decode attention over the paged KV cache: one new query token per sequence, grouped-query
// heads, f32 softmax, as attention_of() in src/math/attention.rs computes it for
// n_new = 1 (append the token's K/V, then attend to cached tokens 0..=pos, or only the last
// sliding_window of them).
//
// KV layout (src/math/kv_cache.rs, KvLayout): each pool is
// [n_blocks][kv_heads][tile], one tile of block_size * head_dim f32 per (block, head) at
// tile(b, h) = (b * kv_heads + h) * block_size * head_dim. Values are rows per slot:
// v_pool[tile + slot * head_dim + dim]. Keys are transposed: k_pool[tile + dim * block_size
// + slot]. Token pos of a sequence lives in block block_tables[seq][pos / block_size],
// slot pos % block_size.
//
// Other operands: qkv is [n_seqs, row_width] f32 rows laid out [q | k | v] (row_width =
// (heads + 2 * kv_heads) * head_dim), then, for gpt-oss, `heads` sink logits at column
// sink_col (sink_col < 0: no sinks; a sink joins the softmax's max and denominator and
// has no value row), rotary already applied. context_lens[seq] is the number of tokens cached
// before this one, so the query sits at pos = context_lens[seq]. block_tables is
// [n_seqs, max_blocks] unsigned int; the caller guarantees it covers pos + 1 tokens with
// block ids inside the pools (the CPU kernel checks the same and reports an error).
// scores is caller-owned f32 scratch [n_seqs, heads, max_keys] with max_keys >= the
// longest attended span; out is [n_seqs, heads * head_dim].
//
// Launch paged_kv_append first: grid = (n_seqs, kv_heads), block = (threads). Then
// paged_decode_attention: grid = (n_seqs, kv_heads), block = (threads, a multiple of 32),
// dynamic shared memory = (heads / kv_heads) * head_dim * sizeof(float) for the query
// group. Each block serves one (sequence, kv head) and every query head of its group, so
// a key tile is read by one block. A score is q . k summed over dim in order with fmaf,
// times scale; outputs accumulate p * v key by key with fmaf: the order (and, on AVX-512,
// the fused rounding) of the CPU's key_scores_transposed and weighted_rows. The softmax's
// max and sum are reduced as a tree and expf is CUDA's, so probabilities agree with the
// CPU to rounding, not bit for bit. The bodies are paged_attention.cuh's, shared with
// prefill_attention.cu: here a launch row is a sequence, at position context_lens[seq].

#include "paged_attention.cuh"

extern "C" __global__ void paged_kv_append(
    const float* __restrict__ qkv,
    float* __restrict__ k_pool,
    float* __restrict__ v_pool,
    const unsigned int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int max_blocks,
    int row_width) {
    const size_t seq = blockIdx.x;
    moec_paged_kv_append(qkv, k_pool, v_pool, block_tables + seq * max_blocks, seq,
                         context_lens[seq], blockIdx.y, heads, kv_heads, head_dim,
                         block_size, row_width);
}

extern "C" __global__ void paged_decode_attention(
    const float* __restrict__ qkv,
    const float* __restrict__ k_pool,
    const float* __restrict__ v_pool,
    const unsigned int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    float* __restrict__ scores,
    float* __restrict__ out,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int max_blocks,
    int max_keys,
    int sliding_window,
    float scale,
    int row_width,
    int sink_col) {
    extern __shared__ float q_group[];
    const size_t seq = blockIdx.x;
    moec_paged_attend(qkv, k_pool, v_pool, block_tables + seq * max_blocks, seq,
                      context_lens[seq], blockIdx.y, q_group, scores, out, heads, kv_heads,
                      head_dim, block_size, max_keys, sliding_window, scale, row_width,
                      sink_col);
}
