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
// CPU to rounding, not bit for bit.

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
    const int head = blockIdx.y;
    const int pos = context_lens[seq];
    const size_t block = block_tables[seq * max_blocks + pos / block_size];
    const int slot = pos % block_size;
    const float* k_src = qkv + seq * (size_t)row_width + (size_t)(heads + head) * head_dim;
    const float* v_src = qkv + seq * (size_t)row_width + (size_t)(heads + kv_heads + head) * head_dim;
    const size_t tile = (block * kv_heads + head) * (size_t)block_size * head_dim;
    for (int dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
        v_pool[tile + (size_t)slot * head_dim + dim] = v_src[dim];
        k_pool[tile + (size_t)dim * block_size + slot] = k_src[dim];
    }
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
    const int kv_head = blockIdx.y;
    const int group = heads / kv_heads;
    const int pos = context_lens[seq];
    const int start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
    const int n_keys = pos + 1 - start;
    const float* q_src = qkv + seq * (size_t)row_width + (size_t)kv_head * group * head_dim;
    for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
        q_group[i] = q_src[i];
    }
    __syncthreads();
    const unsigned int* table = block_tables + seq * max_blocks;
    const size_t tile_elems = (size_t)block_size * head_dim;
    for (int g = 0; g < group; ++g) {
        const int q_head = kv_head * group + g;
        float* head_scores = scores + (seq * heads + q_head) * (size_t)max_keys;
        const float* q = q_group + g * head_dim;
        float local_max = __int_as_float(0xff800000);
        for (int r = threadIdx.x; r < n_keys; r += blockDim.x) {
            const int key_pos = start + r;
            const size_t block = table[key_pos / block_size];
            const float* k_tile = k_pool + (block * kv_heads + kv_head) * tile_elems;
            const int slot = key_pos % block_size;
            float acc = 0.0f;
            for (int dim = 0; dim < head_dim; ++dim) {
                acc = fmaf(q[dim], k_tile[(size_t)dim * block_size + slot], acc);
            }
            const float score = acc * scale;
            head_scores[r] = score;
            local_max = fmaxf(local_max, score);
        }
        // gpt-oss: the head's sink logit (carried in its qkv row) joins the max and the
        // denominator but has no value row.
        const float sink = sink_col >= 0 ? qkv[seq * (size_t)row_width + sink_col + q_head] : 0.0f;
        const float row_max = moec_block_reduce(local_max, 1);
        const float max = sink_col >= 0 ? fmaxf(row_max, sink) : row_max;
        float local_sum = 0.0f;
        for (int r = threadIdx.x; r < n_keys; r += blockDim.x) {
            const float e = expf(head_scores[r] - max);
            head_scores[r] = e;
            local_sum += e;
        }
        const float sum = moec_block_reduce(local_sum, 0) + (sink_col >= 0 ? expf(sink - max) : 0.0f);
        const float inv = 1.0f / sum;
        for (int r = threadIdx.x; r < n_keys; r += blockDim.x) {
            head_scores[r] *= inv;
        }
        __syncthreads();
        float* dst = out + seq * (size_t)heads * head_dim + (size_t)q_head * head_dim;
        for (int dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
            float acc = 0.0f;
            for (int r = 0; r < n_keys; ++r) {
                const int key_pos = start + r;
                const size_t block = table[key_pos / block_size];
                const float* v_tile = v_pool + (block * kv_heads + kv_head) * tile_elems;
                const size_t slot = key_pos % block_size;
                acc = fmaf(head_scores[r], v_tile[slot * head_dim + dim], acc);
            }
            dst[dim] = acc;
        }
        __syncthreads();
    }
}
