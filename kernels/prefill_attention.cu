// Prefill (and mixed) attention over the paged KV cache: any number of new tokens per
// sequence, causal, grouped-query heads, f32 softmax, as attention_of() in
// src/math/attention.rs computes it for n_new >= 1: first every new token's K/V is
// appended, then each new token attends to its sequence's tokens 0..=pos (or only the last
// sliding_window of them), including the other new tokens before it.
//
// The KV layout, qkv rows, block tables, scores scratch and the summation order are those
// of decode_attention.cu (read its header); the difference is that a launch covers n_rows
// new tokens, described per row: row_seq[row] is the row's sequence (its block table is
// block_tables[row_seq[row]]) and row_pos[row] its absolute position. qkv, scores and out
// are per row ([n_rows, ...]). The caller guarantees the tables cover every row_pos + 1.
//
// Launch paged_kv_append_rows first: grid = (n_rows, kv_heads), block = (threads). Then,
// in stream order, paged_prefill_attention: grid = (n_rows, kv_heads * chunks), each block
// serving ceil(group / chunks) <= MOEC_ATTEND_MAX_HEADS query heads of one kv head's group
// (group = heads / kv_heads), block = (threads, a multiple of 32), dynamic shared memory =
// ceil(group / chunks) * head_dim * sizeof(float). The bodies are paged_attention.cuh's
// (the append is decode_attention.cu's, the attention mla_attention.cu's).

#include "paged_attention.cuh"

extern "C" __global__ void paged_kv_append_rows(
    const float* __restrict__ qkv,
    float* __restrict__ k_pool,
    float* __restrict__ v_pool,
    const unsigned int* __restrict__ block_tables,
    const unsigned int* __restrict__ row_seq,
    const int* __restrict__ row_pos,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int max_blocks,
    int row_width) {
    const size_t row = blockIdx.x;
    const size_t seq = row_seq[row];
    moec_paged_kv_append(qkv, k_pool, v_pool, block_tables + seq * max_blocks, row,
                         row_pos[row], blockIdx.y, heads, kv_heads, head_dim, block_size,
                         row_width);
}

extern "C" __global__ void paged_prefill_attention(
    const float* __restrict__ qkv,
    const float* __restrict__ k_pool,
    const float* __restrict__ v_pool,
    const unsigned int* __restrict__ block_tables,
    const unsigned int* __restrict__ row_seq,
    const int* __restrict__ row_pos,
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
    const size_t row = blockIdx.x;
    const size_t seq = row_seq[row];
    const int group = heads / kv_heads;
    const int chunks = gridDim.y / kv_heads;
    const int per_block = (group + chunks - 1) / chunks;
    const int kv_head = blockIdx.y / chunks;
    const int first = (blockIdx.y % chunks) * per_block;
    const int count = group - first < per_block ? group - first : per_block;
    if (per_block > MOEC_ATTEND_MAX_HEADS || count <= 0) {
        return;
    }
    moec_paged_attend(qkv, k_pool, v_pool, block_tables + seq * max_blocks, row, row_pos[row],
                      kv_head, kv_head * group + first, count, q_group, scores, out, heads,
                      kv_heads, head_dim, block_size, max_keys, sliding_window, scale,
                      row_width, sink_col, head_dim);
}
