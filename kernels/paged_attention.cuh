// The paged-attention body decode_attention.cu and prefill_attention.cu share: appending a
// row's K/V to the paged cache and attending one query row over its sequence's cached
// keys. Each file's kernels only find their row's sequence and position (decode: a
// sequence per launch row, its position its context length; prefill: per-row tables) and
// call these, so the two kernels cannot drift apart in layout or summation order.
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

// Every query head of kv head `kv_head`'s group for qkv row `row` at position `pos`,
// attending to cache positions 0..=pos (or the last sliding_window of them); q_group is
// the block's dynamic shared memory of group * head_dim floats.
__device__ __forceinline__ void moec_paged_attend(
    const float* __restrict__ qkv,
    const float* __restrict__ k_pool,
    const float* __restrict__ v_pool,
    const unsigned int* __restrict__ table,
    size_t row,
    int pos,
    int kv_head,
    float* __restrict__ q_group,
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
    int sink_col) {
    const int group = heads / kv_heads;
    const int start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
    const int n_keys = pos + 1 - start;
    const float* q_src = qkv + row * (size_t)row_width + (size_t)kv_head * group * head_dim;
    for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
        q_group[i] = q_src[i];
    }
    __syncthreads();
    const size_t tile_elems = (size_t)block_size * head_dim;
    for (int g = 0; g < group; ++g) {
        const int q_head = kv_head * group + g;
        float* head_scores = scores + (row * heads + q_head) * (size_t)max_keys;
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
        const float sink = sink_col >= 0 ? qkv[row * (size_t)row_width + sink_col + q_head] : 0.0f;
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
        float* dst = out + row * (size_t)heads * head_dim + (size_t)q_head * head_dim;
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
