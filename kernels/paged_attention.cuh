// The paged-attention bodies the kernel files share: appending a row's K/V to the paged
// cache (decode_attention.cu, prefill_attention.cu) and attending one query row over its
// sequence's cached keys (prefill_attention.cu, mla_attention.cu's MLA). Each kernel only
// finds its row's sequence, position and heads and calls these, so the kernels cannot
// drift apart in layout or summation order (decode_attention.cu's split-KV kernel has its
// own online-softmax body over the same layout).
//
// KV layout, operands and summation order: decode_attention.cu's header. `row` indexes
// qkv, scores and out; `table` is the row's sequence's block table; `pos` the row's
// absolute position. runtime::cuda::kernels::full_source puts this file's text where a
// kernel file includes it, so NVRTC needs no include path and a moec binary no kernels
// folder.

// K/V of qkv row `row` into cache position `pos` of head `head` (one launch block per
// (row, kv head); threads stride over the head's dimensions).
__device__ __forceinline__ void moec_paged_kv_append(
    const float* __restrict__ qkv,
    float* __restrict__ k_pool,
    float* __restrict__ v_pool,
    const unsigned int* __restrict__ table,
    size_t row,
    int pos,
    int head,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int row_width) {
    const size_t block = table[pos / block_size];
    const int slot = pos % block_size;
    const float* k_src = qkv + row * (size_t)row_width + (size_t)(heads + head) * head_dim;
    const float* v_src = qkv + row * (size_t)row_width + (size_t)(heads + kv_heads + head) * head_dim;
    const size_t tile = (block * kv_heads + head) * (size_t)block_size * head_dim;
    for (int dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
        v_pool[tile + (size_t)slot * head_dim + dim] = v_src[dim];
        k_pool[tile + (size_t)dim * block_size + slot] = k_src[dim];
    }
}

// Up to MOEC_ATTEND_MAX_HEADS query heads h0 .. h0 + count of kv head `kv_head` (all
// heads of the block) for qkv row `row` at position `pos`, attending to cache positions
// 0..=pos (or the last sliding_window of them); q_heads is the block's dynamic shared
// memory of count * head_dim floats. Each key is read once for every head of the block:
// the scores of all its heads first (q . k over dim in order with fmaf, times scale), then
// each head's softmax over the block, then outputs over (head, dim) pairs (p * v key by
// key with fmaf). Output columns at or past value_dim are 0 without reading V (MLA's V is
// [c | 0]; value_dim = head_dim elsewhere).
#define MOEC_ATTEND_MAX_HEADS 16

__device__ __forceinline__ void moec_paged_attend(
    const float* __restrict__ qkv,
    const float* __restrict__ k_pool,
    const float* __restrict__ v_pool,
    const unsigned int* __restrict__ table,
    size_t row,
    int pos,
    int kv_head,
    int h0,
    int count,
    float* __restrict__ q_heads,
    float* __restrict__ scores,
    float* __restrict__ out,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int max_keys,
    int sliding_window,
    float scale,
    int row_width,
    int sink_col,
    int value_dim) {
    const int start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
    const int n_keys = pos + 1 - start;
    const float* q_src = qkv + row * (size_t)row_width + (size_t)h0 * head_dim;
    for (int i = threadIdx.x; i < count * head_dim; i += blockDim.x) {
        q_heads[i] = q_src[i];
    }
    __syncthreads();
    const size_t tile_elems = (size_t)block_size * head_dim;
    for (int k = threadIdx.x; k < n_keys; k += blockDim.x) {
        const int key_pos = start + k;
        const float* k_tile = k_pool + ((size_t)table[key_pos / block_size] * kv_heads + kv_head) * tile_elems;
        const int slot = key_pos % block_size;
        float acc[MOEC_ATTEND_MAX_HEADS];
        for (int g = 0; g < count; ++g) {
            acc[g] = 0.0f;
        }
        for (int dim = 0; dim < head_dim; ++dim) {
            const float kv = k_tile[(size_t)dim * block_size + slot];
            for (int g = 0; g < count; ++g) {
                acc[g] = fmaf(q_heads[g * head_dim + dim], kv, acc[g]);
            }
        }
        for (int g = 0; g < count; ++g) {
            scores[(row * heads + h0 + g) * (size_t)max_keys + k] = acc[g] * scale;
        }
    }
    __syncthreads();
    for (int g = 0; g < count; ++g) {
        const int q_head = h0 + g;
        float* head_scores = scores + (row * heads + q_head) * (size_t)max_keys;
        float local_max = __int_as_float(0xff800000);
        for (int k = threadIdx.x; k < n_keys; k += blockDim.x) {
            local_max = fmaxf(local_max, head_scores[k]);
        }
        // gpt-oss: the head's sink logit (carried in its qkv row) joins the max and the
        // denominator but has no value row.
        const float sink = sink_col >= 0 ? qkv[row * (size_t)row_width + sink_col + q_head] : 0.0f;
        const float row_max = moec_block_reduce(local_max, 1);
        const float max = sink_col >= 0 ? fmaxf(row_max, sink) : row_max;
        float local_sum = 0.0f;
        for (int k = threadIdx.x; k < n_keys; k += blockDim.x) {
            const float e = expf(head_scores[k] - max);
            head_scores[k] = e;
            local_sum += e;
        }
        const float sum = moec_block_reduce(local_sum, 0) + (sink_col >= 0 ? expf(sink - max) : 0.0f);
        const float inv = 1.0f / sum;
        for (int k = threadIdx.x; k < n_keys; k += blockDim.x) {
            head_scores[k] *= inv;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < count * head_dim; i += blockDim.x) {
        const int g = i / head_dim;
        const int dim = i % head_dim;
        const int q_head = h0 + g;
        float acc = 0.0f;
        if (dim < value_dim) {
            const float* head_scores = scores + (row * heads + q_head) * (size_t)max_keys;
            for (int k = 0; k < n_keys; ++k) {
                const int key_pos = start + k;
                const float* v_tile = v_pool + ((size_t)table[key_pos / block_size] * kv_heads + kv_head) * tile_elems;
                const size_t slot = key_pos % block_size;
                acc = fmaf(head_scores[k], v_tile[slot * head_dim + dim], acc);
            }
        }
        out[row * (size_t)heads * head_dim + (size_t)q_head * head_dim + dim] = acc;
    }
}
