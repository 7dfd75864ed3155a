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
#include "tensor_core.cuh"

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

// ---- Prefill attention on tensor cores ---------------------------------------------------
// paged_prefill_attention's result (the same operands, after paged_kv_append_rows) as
// flash attention: a block (one warp) takes 16 consecutive rows of the launch and one query
// head, and walks its sequence's keys 16 at a time with an online softmax (running max
// and sum per row, the output rescaled when the max grows), Q . K^T and P . V as 16x16x16
// bf16 tiles with f32 accumulation (kernels/tensor_core.cuh). Every f32 operand is split
// into a bf16 pair (moec_split_bf16: hi + lo carry 16 significant bits) and a product
// taken as hi.hi + hi.lo + lo.hi (the lo.lo term is below 2^-16 of it), so scores and
// outputs keep ~1e-5 relative precision instead of bf16's 4e-3. The rows of a tile may
// belong to several sequences (a launch packs sequences' rows back to back): the block
// takes one sequence's rows at a time, the others masked. A row attends to its positions
// start..=pos (causal, the sliding window's start) and a sink logit (gpt-oss) joins the max
// and the sum as a key without a value, as in moec_paged_attend. head_dim at most
// MOEC_ATTN_MMA_MAX_DIM (the host checks; rows padded with zeros to a multiple of 16).
// Queries, keys and values are staged MOEC_ATTN_BATCH loads a lane at a time, all in flight
// before they are split and stored (keys as half-warps over 16 consecutive slots of the
// transposed cache, values along rows), each tile's block ids read one tile ahead.
// `scores` is not used (the scores stay in shared memory); `n_rows`: rows of the launch.
// Launch: grid (ceil(n_rows / 16), heads), block 32, no dynamic shared memory.
#define MOEC_ATTN_MMA_MAX_DIM 128
#define MOEC_ATTN_LDQ (MOEC_ATTN_MMA_MAX_DIM + 8)
#define MOEC_ATTN_LDP 24
// Global loads a lane issues before it stores any (the staging of queries, keys, values).
#define MOEC_ATTN_BATCH 8

extern "C" __global__ void paged_prefill_attention_mma(
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
    int sink_col,
    int n_rows) {
    // Queries (hi, lo) [row][dim]; keys (hi, lo) [key][dim] (B of Q . K^T, column-major);
    // values (hi, lo) [dim][key] (B of P . V, column-major); probabilities (hi, lo)
    // [row][key]; a score tile; the output accumulator [row][dim]; per row the running max,
    // sum and this step's rescale.
    __shared__ __align__(32) unsigned short at_q[2][16 * MOEC_ATTN_LDQ];
    __shared__ __align__(32) unsigned short at_k[2][16 * MOEC_ATTN_LDQ];
    __shared__ __align__(32) unsigned short at_v[2][MOEC_ATTN_MMA_MAX_DIM * MOEC_ATTN_LDP];
    __shared__ __align__(32) unsigned short at_p[2][16 * MOEC_ATTN_LDP];
    __shared__ __align__(32) float at_s[16 * 16];
    __shared__ __align__(32) float at_o[16 * MOEC_ATTN_LDQ];
    __shared__ float at_max[16];
    __shared__ float at_sum[16];
    __shared__ float at_alpha[16];
    const int r0 = blockIdx.x * 16;
    const int head = blockIdx.y;
    const int kv_head = head / (heads / kv_heads);
    const int rows = n_rows - r0 < 16 ? n_rows - r0 : 16;
    const int lane = threadIdx.x;
    const int dims = (head_dim + 15) / 16 * 16;
    const float neg_inf = __int_as_float(0xff800000);
    if (rows <= 0 || head_dim > MOEC_ATTN_MMA_MAX_DIM) {
        return;
    }
    int done = 0;
    while (true) {
        // The first row not yet attended names the sequence of this pass.
        int lead = -1;
        for (int r = 0; r < rows; ++r) {
            if (((done >> r) & 1) == 0) {
                lead = r;
                break;
            }
        }
        if (lead < 0) {
            break;
        }
        const unsigned int seq = row_seq[r0 + lead];
        int mine = 0;
        int key_first = 0x7fffffff;
        int key_last = -1;
        for (int r = lead; r < rows; ++r) {
            if (((done >> r) & 1) == 0 && row_seq[r0 + r] == seq) {
                mine |= 1 << r;
                const int pos = row_pos[r0 + r];
                const int start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
                key_first = start < key_first ? start : key_first;
                key_last = pos > key_last ? pos : key_last;
            }
        }
        done |= mine;
        const unsigned int* table = block_tables + (size_t)seq * max_blocks;
        // The pass's queries, MOEC_ATTN_BATCH loads a lane in flight before their stores.
        for (int base = 0; base < 16 * dims; base += 32 * MOEC_ATTN_BATCH) {
            float x[MOEC_ATTN_BATCH];
#pragma unroll
            for (int b = 0; b < MOEC_ATTN_BATCH; ++b) {
                const int i = base + b * 32 + lane;
                const int r = i / dims;
                const int d = i % dims;
                x[b] = i < 16 * dims && ((mine >> r) & 1) != 0 && d < head_dim
                           ? qkv[(size_t)(r0 + r) * row_width + (size_t)head * head_dim + d]
                           : 0.0f;
            }
#pragma unroll
            for (int b = 0; b < MOEC_ATTN_BATCH; ++b) {
                const int i = base + b * 32 + lane;
                if (i < 16 * dims) {
                    const int r = i / dims;
                    const int d = i % dims;
                    moec_split_bf16(x[b], &at_q[0][r * MOEC_ATTN_LDQ + d], &at_q[1][r * MOEC_ATTN_LDQ + d]);
                    at_o[r * MOEC_ATTN_LDQ + d] = 0.0f;
                }
            }
        }
        for (int r = lane; r < 16; r += 32) {
            const bool has_sink = sink_col >= 0 && ((mine >> r) & 1) != 0;
            at_max[r] = has_sink ? qkv[(size_t)(r0 + r) * row_width + sink_col + head] : neg_inf;
            at_sum[r] = has_sink ? 1.0f : 0.0f;
        }
        __syncthreads();
        const size_t tile_elems = (size_t)block_size * head_dim;
        // Lane l's key of the tile (l % 16) and its cache block; the next tile's block is
        // read while this tile computes.
        unsigned int blk_next = key_first + (lane & 15) <= key_last
                                    ? table[(key_first + (lane & 15)) / block_size]
                                    : 0u;
        for (int j0 = key_first; j0 <= key_last; j0 += 16) {
            const unsigned int blk_lane = blk_next;
            const int kp_next = j0 + 16 + (lane & 15);
            blk_next = kp_next <= key_last ? table[kp_next / block_size] : 0u;
            // Keys j0 .. j0 + 15 (zeros past key_last) as bf16 pairs, MOEC_ATTN_BATCH K and
            // V loads a lane in flight before their stores: K element i is key i % 16 of
            // dim i / 16 (a half-warp reads 16 consecutive slots of the transposed cache),
            // V element i dim i % dims of key i / dims (consecutive dims of a row).
            for (int base = 0; base < 16 * dims; base += 32 * MOEC_ATTN_BATCH) {
                float kx[MOEC_ATTN_BATCH];
                float vx[MOEC_ATTN_BATCH];
                // V element (v_key, v_dim) of i, stepped by 32 (dims >= 16: at most two wraps).
                int v_key = (base + lane) / dims;
                int v_dim = (base + lane) % dims;
#pragma unroll
                for (int b = 0; b < MOEC_ATTN_BATCH; ++b) {
                    const int i = base + b * 32 + lane;
                    const int k_key = i & 15;
                    const int k_dim = i >> 4;
                    const unsigned int k_blk = (unsigned int)__shfl_sync(0xffffffffu, (int)blk_lane, k_key);
                    const unsigned int v_blk = (unsigned int)__shfl_sync(0xffffffffu, (int)blk_lane, v_key & 15);
                    kx[b] = 0.0f;
                    vx[b] = 0.0f;
                    if (i < 16 * dims && j0 + k_key <= key_last && k_dim < head_dim) {
                        const int kp = j0 + k_key;
                        kx[b] = k_pool[((size_t)k_blk * kv_heads + kv_head) * tile_elems +
                                       (size_t)k_dim * block_size + kp % block_size];
                    }
                    if (i < 16 * dims && j0 + v_key <= key_last && v_dim < head_dim) {
                        const int kp = j0 + v_key;
                        vx[b] = v_pool[((size_t)v_blk * kv_heads + kv_head) * tile_elems +
                                       (size_t)(kp % block_size) * head_dim + v_dim];
                    }
                    for (v_dim += 32; v_dim >= dims; v_dim -= dims) {
                        ++v_key;
                    }
                }
                v_key = (base + lane) / dims;
                v_dim = (base + lane) % dims;
#pragma unroll
                for (int b = 0; b < MOEC_ATTN_BATCH; ++b) {
                    const int i = base + b * 32 + lane;
                    if (i < 16 * dims) {
                        const int k_key = i & 15;
                        const int k_dim = i >> 4;
                        moec_split_bf16(kx[b], &at_k[0][k_key * MOEC_ATTN_LDQ + k_dim],
                                        &at_k[1][k_key * MOEC_ATTN_LDQ + k_dim]);
                        moec_split_bf16(vx[b], &at_v[0][v_dim * MOEC_ATTN_LDP + v_key],
                                        &at_v[1][v_dim * MOEC_ATTN_LDP + v_key]);
                    }
                    for (v_dim += 32; v_dim >= dims; v_dim -= dims) {
                        ++v_key;
                    }
                }
            }
            __syncthreads();
            MoecMmaAcc acc;
            moec_mma_zero(acc);
            for (int kk = 0; kk < dims; kk += 16) {
                MoecMmaAB qh, ql, kh, kl;
                moec_mma_load_a(qh, &at_q[0][kk], MOEC_ATTN_LDQ);
                moec_mma_load_a(ql, &at_q[1][kk], MOEC_ATTN_LDQ);
                moec_mma_load_b(kh, &at_k[0][kk], MOEC_ATTN_LDQ);
                moec_mma_load_b(kl, &at_k[1][kk], MOEC_ATTN_LDQ);
                moec_mma(acc, qh, kh);
                moec_mma(acc, qh, kl);
                moec_mma(acc, ql, kh);
            }
            moec_mma_store(at_s, acc, 16);
            __syncthreads();
            // Online softmax: lane r < 16 updates row r's max and sum and writes its
            // probabilities; rows of other sequences get p = 0 and keep their output.
            for (int r = lane; r < 16; r += 32) {
                float alpha = 1.0f;
                float p[16];
                if (((mine >> r) & 1) != 0) {
                    const int pos = row_pos[r0 + r];
                    const int start = sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
                    float m = at_max[r];
                    for (int j = 0; j < 16; ++j) {
                        const int kp = j0 + j;
                        p[j] = kp >= start && kp <= pos ? at_s[r * 16 + j] * scale : neg_inf;
                        m = fmaxf(m, p[j]);
                    }
                    if (m == neg_inf) {
                        for (int j = 0; j < 16; ++j) {
                            p[j] = 0.0f;
                        }
                    } else {
                        alpha = at_max[r] == neg_inf ? 0.0f : expf(at_max[r] - m);
                        float sum = 0.0f;
                        for (int j = 0; j < 16; ++j) {
                            p[j] = p[j] == neg_inf ? 0.0f : expf(p[j] - m);
                            sum += p[j];
                        }
                        at_sum[r] = at_sum[r] * alpha + sum;
                        at_max[r] = m;
                    }
                } else {
                    for (int j = 0; j < 16; ++j) {
                        p[j] = 0.0f;
                    }
                }
                at_alpha[r] = alpha;
                for (int j = 0; j < 16; ++j) {
                    moec_split_bf16(p[j], &at_p[0][r * MOEC_ATTN_LDP + j], &at_p[1][r * MOEC_ATTN_LDP + j]);
                }
            }
            __syncthreads();
            for (int i = lane; i < 16 * dims; i += 32) {
                const int r = i / dims;
                at_o[r * MOEC_ATTN_LDQ + i % dims] *= at_alpha[r];
            }
            __syncthreads();
            MoecMmaAB ph, pl;
            moec_mma_load_a(ph, &at_p[0][0], MOEC_ATTN_LDP);
            moec_mma_load_a(pl, &at_p[1][0], MOEC_ATTN_LDP);
            for (int slab = 0; slab < dims; slab += 16) {
                MoecMmaAB vh, vl;
                MoecMmaAcc o;
                moec_mma_load_c(o, &at_o[slab], MOEC_ATTN_LDQ);
                moec_mma_load_b(vh, &at_v[0][slab * MOEC_ATTN_LDP], MOEC_ATTN_LDP);
                moec_mma_load_b(vl, &at_v[1][slab * MOEC_ATTN_LDP], MOEC_ATTN_LDP);
                moec_mma(o, ph, vh);
                moec_mma(o, ph, vl);
                moec_mma(o, pl, vh);
                moec_mma_store(&at_o[slab], o, MOEC_ATTN_LDQ);
            }
            __syncthreads();
        }
        for (int i = lane; i < 16 * head_dim; i += 32) {
            const int r = i / head_dim;
            const int d = i % head_dim;
            if (((mine >> r) & 1) != 0) {
                out[(size_t)(r0 + r) * heads * head_dim + (size_t)head * head_dim + d] =
                    at_o[r * MOEC_ATTN_LDQ + d] / at_sum[r];
            }
        }
        __syncthreads();
    }
}
