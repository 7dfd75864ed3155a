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
// out is [n_seqs, heads * head_dim].
//
// paged_decode_attention is split-KV ("flash-decoding"): grid = (n_seqs, kv_heads *
// head_chunks, n_splits), block = MOEC_DECODE_WARPS * 32 threads, dynamic shared memory =
// ((1 + MOEC_DECODE_WARPS) * head_dim + 2 * MOEC_DECODE_WARPS) * g * sizeof(float) with
// g = min(group, MOEC_DECODE_MAX_GROUP); head_dim <= 32 * MOEC_DECODE_MAX_DIMS. A block
// serves one sequence, one kv head and up to MOEC_DECODE_MAX_GROUP of its query heads (head_chunks = ceil(group / that)), so each key
// and value row is read once for the whole group (GQA), over split `blockIdx.z`'s
// split_keys keys of the attended span. Its warps take 32-key tiles in turn, a key per
// lane: the lane's scores for every head of the group (q . k over dim in order with fmaf,
// times scale: the CPU's key_scores_transposed order), an online softmax in registers (the
// running max and sum rescaled per tile), then the tile's value rows, each lane holding
// head_dim / 32 output columns and loading them as one vector. The warps' states merge in
// shared memory. With one split the block writes out; with several it writes its state
// (max, sum, unnormalised output) to `partials` and paged_decode_combine merges the splits:
// grid = (n_seqs, heads), block = (threads). partials is [n_seqs, heads, n_splits, 2] (max,
// sum) followed by [n_seqs, heads, n_splits, head_dim]; unused with one split (any valid
// pointer). The softmax's max and sums are merged as trees and expf is CUDA's, so outputs
// agree with the CPU to rounding, not bit for bit.
//
// The token's own key and value are read from its qkv row, not the cache; with append = 1
// the blocks of split 0 and the first head chunk also write them into the pools
// (paged_kv_append's work, one launch fewer), which no block of the launch reads.
// paged_kv_append: grid = (n_seqs, kv_heads), block = (threads), for callers that append
// without attending. The append body is paged_attention.cuh's, shared with
// prefill_attention.cu.

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


#define MOEC_DECODE_WARPS 4
#define MOEC_DECODE_MAX_GROUP 8
#define MOEC_DECODE_MAX_DIMS 8
// Key columns (scores) and value rows (outputs) whose loads a lane issues together.
#define MOEC_DECODE_BATCH 16
#define MOEC_DECODE_V_BATCH 8

__device__ __forceinline__ float moec_warp_max(float v) {
    for (int off = 16; off > 0; off /= 2) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    }
    return v;
}

__device__ __forceinline__ float moec_warp_sum(float v) {
    for (int off = 16; off > 0; off /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
}

// exp(m - max) as a merge weight: 0 for a state that saw no key (m = -inf), whatever max is.
__device__ __forceinline__ float moec_merge_weight(float m, float max) {
    return m == __int_as_float(0xff800000) ? 0.0f : expf(m - max);
}

// One block of paged_decode_attention (read the header), DPL output columns per lane.
template <int DPL>
__device__ __forceinline__ void moec_paged_decode_split(
    const float* __restrict__ qkv,
    float* __restrict__ k_pool,
    float* __restrict__ v_pool,
    const unsigned int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    float* __restrict__ partials,
    float* __restrict__ out,
    float* __restrict__ smem,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int max_blocks,
    int split_keys,
    int sliding_window,
    float scale,
    int row_width,
    int sink_col,
    int append) {
    const float neg_inf = __int_as_float(0xff800000);
    const size_t seq = blockIdx.x;
    const int group = heads / kv_heads;
    const int chunks = (group + MOEC_DECODE_MAX_GROUP - 1) / MOEC_DECODE_MAX_GROUP;
    const int kv_head = blockIdx.y / chunks;
    const int g0 = (blockIdx.y % chunks) * MOEC_DECODE_MAX_GROUP;
    const int g_block = min(group, MOEC_DECODE_MAX_GROUP);
    const int gn = min(MOEC_DECODE_MAX_GROUP, group - g0);
    const int first_head = kv_head * group + g0;
    const int pos = context_lens[seq];
    const unsigned int* table = block_tables + seq * (size_t)max_blocks;
    const int start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
    const int n_keys = pos + 1 - start;
    const int k_begin = (int)blockIdx.z * split_keys;
    const int k_end = min(n_keys, k_begin + split_keys);
    const size_t tile_elems = (size_t)block_size * head_dim;
    const float* row = qkv + seq * (size_t)row_width;
    const float* own_k = row + (size_t)(heads + kv_head) * head_dim;
    const float* own_v = row + (size_t)(heads + kv_heads + kv_head) * head_dim;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;

    if (append && blockIdx.z == 0 && g0 == 0) {
        moec_paged_kv_append(qkv, k_pool, v_pool, table, seq, pos, kv_head, heads, kv_heads,
                             head_dim, block_size, row_width);
    }
    // Shared memory: the group's queries [g_block][head_dim], then each warp's unnormalised
    // outputs [warps][g_block][head_dim], maxima [warps][g_block] and sums [warps][g_block].
    float* q_sh = smem;
    float* acc_sh = q_sh + (size_t)g_block * head_dim;
    float* m_sh = acc_sh + (size_t)MOEC_DECODE_WARPS * g_block * head_dim;
    float* l_sh = m_sh + MOEC_DECODE_WARPS * g_block;
    for (int i = threadIdx.x; i < gn * head_dim; i += blockDim.x) {
        q_sh[i] = row[(size_t)first_head * head_dim + i];
    }
    __syncthreads();

    float m[MOEC_DECODE_MAX_GROUP];
    float l[MOEC_DECODE_MAX_GROUP];
    float acc[MOEC_DECODE_MAX_GROUP][DPL];
#pragma unroll
    for (int g = 0; g < MOEC_DECODE_MAX_GROUP; ++g) {
        m[g] = neg_inf;
        l[g] = 0.0f;
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
            acc[g][k] = 0.0f;
        }
    }
    const int col = lane * DPL;
    // Whole vectors: every lane's columns exist and rows start 8- or 16-byte aligned.
    const bool vec = DPL >= 2 && head_dim == 32 * DPL &&
                     (((unsigned long long)v_pool | (unsigned long long)own_v) % (4 * DPL)) == 0;
    for (int tile = k_begin + warp * 32; tile < k_end; tile += MOEC_DECODE_WARPS * 32) {
        const int key = tile + lane;
        const bool valid = key < k_end;
        const int abs_pos = start + key;
        unsigned int blk = 0;
        float s[MOEC_DECODE_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MOEC_DECODE_MAX_GROUP; ++g) {
            s[g] = 0.0f;
        }
        if (valid) {
            // The token's own key from its qkv row (stride 1), the others from the cache.
            const float* k_src = own_k;
            size_t stride = 1;
            if (abs_pos != pos) {
                blk = table[abs_pos / block_size];
                k_src = k_pool + ((size_t)blk * kv_heads + kv_head) * tile_elems + abs_pos % block_size;
                stride = block_size;
            }
            // MOEC_DECODE_BATCH loads in flight before their products (dims still in order).
            for (int d0 = 0; d0 < head_dim; d0 += MOEC_DECODE_BATCH) {
                float kd[MOEC_DECODE_BATCH];
#pragma unroll
                for (int j = 0; j < MOEC_DECODE_BATCH; ++j) {
                    kd[j] = d0 + j < head_dim ? k_src[(size_t)(d0 + j) * stride] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < MOEC_DECODE_BATCH; ++j) {
                    if (d0 + j < head_dim) {
#pragma unroll
                        for (int g = 0; g < MOEC_DECODE_MAX_GROUP; ++g) {
                            if (g < gn) {
                                s[g] = fmaf(q_sh[g * head_dim + d0 + j], kd[j], s[g]);
                            }
                        }
                    }
                }
            }
        }
        // Online softmax: the tile's max joins the running max, earlier sums and outputs
        // are rescaled to it, p = exp(score - max) (0 for lanes past the span).
#pragma unroll
        for (int g = 0; g < MOEC_DECODE_MAX_GROUP; ++g) {
            const float score = valid ? s[g] * scale : neg_inf;
            const float m_new = fmaxf(m[g], moec_warp_max(score));
            const float alpha = moec_merge_weight(m[g], m_new);
            s[g] = valid ? expf(score - m_new) : 0.0f;
            l[g] = l[g] * alpha + s[g];
#pragma unroll
            for (int k = 0; k < DPL; ++k) {
                acc[g][k] *= alpha;
            }
            m[g] = m_new;
        }
        const int n_valid = min(32, k_end - tile);
        // Value rows MOEC_DECODE_V_BATCH keys at a time: their loads in flight together,
        // then the products key by key in order.
        for (int j0 = 0; j0 < n_valid; j0 += MOEC_DECODE_V_BATCH) {
            float v[MOEC_DECODE_V_BATCH][DPL];
#pragma unroll
            for (int jj = 0; jj < MOEC_DECODE_V_BATCH; ++jj) {
                const int j = j0 + jj;
                if (j >= n_valid) {
#pragma unroll
                    for (int k = 0; k < DPL; ++k) {
                        v[jj][k] = 0.0f;
                    }
                    continue;
                }
                const int abs_j = start + tile + j;
                const unsigned int blk_j = (unsigned int)__shfl_sync(0xffffffffu, (int)blk, j);
                const float* v_row = abs_j == pos
                    ? own_v
                    : v_pool + ((size_t)blk_j * kv_heads + kv_head) * tile_elems +
                          (size_t)(abs_j % block_size) * head_dim;
                if (vec && DPL % 4 == 0) {
#pragma unroll
                    for (int k = 0; k < DPL; k += 4) {
                        const float4 x = *(const float4*)(v_row + col + k);
                        v[jj][k] = x.x;
                        v[jj][k + 1] = x.y;
                        v[jj][k + 2] = x.z;
                        v[jj][k + 3] = x.w;
                    }
                } else if (vec && DPL == 2) {
                    const float2 x = *(const float2*)(v_row + col);
                    v[jj][0] = x.x;
                    v[jj][1] = x.y;
                } else {
#pragma unroll
                    for (int k = 0; k < DPL; ++k) {
                        v[jj][k] = col + k < head_dim ? v_row[col + k] : 0.0f;
                    }
                }
            }
#pragma unroll
            for (int jj = 0; jj < MOEC_DECODE_V_BATCH; ++jj) {
                if (j0 + jj < n_valid) {
#pragma unroll
                    for (int g = 0; g < MOEC_DECODE_MAX_GROUP; ++g) {
                        const float p = __shfl_sync(0xffffffffu, s[g], j0 + jj);
#pragma unroll
                        for (int k = 0; k < DPL; ++k) {
                            acc[g][k] = fmaf(p, v[jj][k], acc[g][k]);
                        }
                    }
                }
            }
        }
    }
    // The warps' states into shared memory (a warp that saw no key: max -inf, sum 0).
#pragma unroll
    for (int g = 0; g < MOEC_DECODE_MAX_GROUP; ++g) {
        const float sum = moec_warp_sum(l[g]);
        if (g < gn) {
            if (lane == 0) {
                m_sh[warp * g_block + g] = m[g];
                l_sh[warp * g_block + g] = sum;
            }
#pragma unroll
            for (int k = 0; k < DPL; ++k) {
                if (col + k < head_dim) {
                    acc_sh[((size_t)warp * g_block + g) * head_dim + col + k] = acc[g][k];
                }
            }
        }
    }
    __syncthreads();
    const int n_splits = gridDim.z;
    for (int i = threadIdx.x; i < gn * head_dim; i += blockDim.x) {
        const int g = i / head_dim;
        const int d = i % head_dim;
        const int head = first_head + g;
        float max = neg_inf;
        for (int w = 0; w < MOEC_DECODE_WARPS; ++w) {
            max = fmaxf(max, m_sh[w * g_block + g]);
        }
        if (n_splits == 1) {
            // gpt-oss: the head's sink logit joins the max and the denominator.
            const float sink = sink_col >= 0 ? row[sink_col + head] : neg_inf;
            max = fmaxf(max, sink);
        }
        float sum = n_splits == 1 && sink_col >= 0 ? moec_merge_weight(row[sink_col + head], max) : 0.0f;
        float o = 0.0f;
        for (int w = 0; w < MOEC_DECODE_WARPS; ++w) {
            const float f = moec_merge_weight(m_sh[w * g_block + g], max);
            sum += l_sh[w * g_block + g] * f;
            o += acc_sh[((size_t)w * g_block + g) * head_dim + d] * f;
        }
        if (n_splits == 1) {
            out[(seq * heads + head) * (size_t)head_dim + d] = o / sum;
        } else {
            const size_t state = (seq * heads + head) * (size_t)n_splits + blockIdx.z;
            if (d == 0) {
                partials[2 * state] = max;
                partials[2 * state + 1] = sum;
            }
            const size_t states = (size_t)gridDim.x * heads * n_splits;
            partials[2 * states + state * head_dim + d] = o;
        }
    }
}

extern "C" __global__ void paged_decode_attention(
    const float* __restrict__ qkv,
    float* __restrict__ k_pool,
    float* __restrict__ v_pool,
    const unsigned int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    float* __restrict__ partials,
    float* __restrict__ out,
    int heads,
    int kv_heads,
    int head_dim,
    int block_size,
    int max_blocks,
    int split_keys,
    int sliding_window,
    float scale,
    int row_width,
    int sink_col,
    int append) {
    extern __shared__ float q_group[];
#define MOEC_DECODE_SPLIT(DPL)                                                                  \
    moec_paged_decode_split<DPL>(qkv, k_pool, v_pool, block_tables, context_lens, partials,  \
                                 out, q_group, heads, kv_heads, head_dim, block_size,          \
                                 max_blocks, split_keys, sliding_window, scale, row_width,     \
                                 sink_col, append)
    if (head_dim <= 32) {
        MOEC_DECODE_SPLIT(1);
    } else if (head_dim <= 64) {
        MOEC_DECODE_SPLIT(2);
    } else if (head_dim <= 128) {
        MOEC_DECODE_SPLIT(4);
    } else {
        MOEC_DECODE_SPLIT(8);
    }
#undef MOEC_DECODE_SPLIT
}

// Merges paged_decode_attention's n_splits states of one (sequence, head) (read the
// header): the max over the splits (and the sink logit), each split's sum and output
// rescaled to it, the output divided by the total.
extern "C" __global__ void paged_decode_combine(
    const float* __restrict__ qkv,
    const float* __restrict__ partials,
    float* __restrict__ out,
    int heads,
    int head_dim,
    int n_splits,
    int row_width,
    int sink_col) {
    const size_t seq = blockIdx.x;
    const int head = blockIdx.y;
    const size_t first = (seq * heads + head) * (size_t)n_splits;
    const size_t states = (size_t)gridDim.x * heads * n_splits;
    const float sink = sink_col >= 0 ? qkv[seq * (size_t)row_width + sink_col + head]
                                     : __int_as_float(0xff800000);
    float max = sink;
    for (int s = 0; s < n_splits; ++s) {
        max = fmaxf(max, partials[2 * (first + s)]);
    }
    float sum = moec_merge_weight(sink, max);
    for (int s = 0; s < n_splits; ++s) {
        sum += partials[2 * (first + s) + 1] * moec_merge_weight(partials[2 * (first + s)], max);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            o += partials[2 * states + (first + s) * head_dim + d] *
                 moec_merge_weight(partials[2 * (first + s)], max);
        }
        out[(seq * heads + head) * (size_t)head_dim + d] = o / sum;
    }
}
