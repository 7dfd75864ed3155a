// DeepSeek's multi-head latent attention (MLA) on the device, in the absorbed form
// src/math/mla.rs computes on the CPU (read its header): the cache holds one kv
// head of width head_dim = kv_lora_rank (r) + qk_rope_head_dim, K = [c | k_pe] and
// V = [c | 0] (c the normalised latent, k_pe the rotated shared key), and each query head
// is [q_nope W_uk_h | q_pe] scaled so that the attention kernel's 1 / sqrt(head_dim)
// becomes transformers' mscale / sqrt(qk_head_dim). The output of head h is sum p c (its
// rotary columns are exactly 0), which mla_head_linear expands with W_uv_h before o_proj.
//
//   mla_rms_norm         RMSNorm of rows of `width` columns (q_a_layernorm), any stored
//                        weight dtype: out = w * (x * (1 / sqrtf(mean(x^2) + eps)))
//   mla_head_linear      per-head products with one kv_b_proj slice per head, all heads in
//                        one launch: the query absorption (q_nope W_uk_h, scaled) and the
//                        value expansion (latent W_uv_h^T); weights read as stored, f32
//                        accumulation
//   mla_qkv_rows         the rest of a qkv row: each head's q_pe rotated and scaled, the
//                        latent's RMSNorm (kv_a_layernorm) into K and V, k_pe rotated into
//                        K, V's rotary columns zeroed
//   mla_paged_attention  prefill, mixed and decode attention over the paged cache
//
// Layouts: activations are f32 rows, row-major. qkv rows are [heads + 2, head_dim]: the
// heads' queries, K, V, the layout of every other family with kv_heads = 1, so the paged
// append kernels (paged_kv_append / paged_kv_append_rows) store K and V and a cache written
// here is read by the CPU backend's attention and the other way round. Stored weights are
// raw element bits with a dtype code (0 bf16, 1 f16, 2 f32). kv_b_proj is stored
// [heads * (qk_nope + v_head), r] row-major (out, in): head h's W_uk are rows
// h * (qk_nope + v_head) + [0, qk_nope), its W_uv the next v_head rows; a GGUF stores it
// split (attn_k_b [heads * r, qk_nope], attn_v_b [heads * v_head, r]), possibly quantised
// (dtype codes 3..6, decoded block by block by moec_load). Rotary tables are
// [max_positions, rope_dim / 2] f32 (RopeTable's, YaRN-scaled when the card has YaRN);
// `interleave` 1 pairs elements (2i, 2i + 1) (rope_interleave, DeepSeek's checkpoints),
// 0 pairs (i, i + half) (NeoX). The paged pools and block tables are decode_attention.cu's
// (read its header).
//
// Launch: mla_rms_norm: grid = (rows), block = (threads, a multiple of 32).
// mla_head_linear: grid = (ceil(rows / MLA_TILE_M), heads, ceil(out / MLA_TILE_N)),
// block = 256. mla_qkv_rows: grid = (rows, heads + 1), block = (threads, a multiple of 32).
// mla_paged_attention: paged_prefill_attention's operands plus value_dim; grid = (rows,
// head groups), each block serving ceil(heads / head groups) <= MLA_MAX_HEADS_PER_BLOCK
// query heads (one read of each key per group rather than per head), block = (threads, a
// multiple of 32), dynamic shared memory = heads per block * head_dim * sizeof(float).
// Summation orders are the CPU's where it has one (scores and outputs over dims and keys
// in order with fmaf); norms and the softmax reduce as trees, so results agree with the
// CPU to rounding.

#include "paged_attention.cuh"

#define MLA_TILE_M 16
#define MLA_TILE_N 64
#define MLA_TILE_K 32
#define MLA_MAX_HEADS_PER_BLOCK MOEC_ATTEND_MAX_HEADS

extern "C" __global__ void mla_rms_norm(
    const float* __restrict__ x,
    const void* __restrict__ weight,
    float* __restrict__ out,
    int width,
    int dtype,
    float eps) {
    const size_t row = blockIdx.x;
    moec_norm_row(x + row * (size_t)width, weight, dtype, out + row * (size_t)width, width, eps,
                  0, blockDim.x);
}

// y[t * y_ld + y_off + h * y_head + o] = scale * sum_i x[t * x_ld + x_off + h * x_head + i]
// * W_h(i, o) for o < out_dim, i < in_dim, where W_h is rows h * w_head_rows + w_row_off...
// of the stored [*, w_cols] matrix `w`:
//   out_in 1: W_h(i, o) = w[(h * w_head_rows + w_row_off + o) * w_cols + i]  (in_dim <= w_cols)
//   out_in 0: W_h(i, o) = w[(h * w_head_rows + w_row_off + i) * w_cols + o]  (out_dim <= w_cols)
// From kv_b_proj, the query absorption is out_in 0 (W_uk_h read as [qk_nope, r]), the value
// expansion out_in 1 (W_uv_h as [v_head, r]). From llama.cpp's split halves both are out_in
// 1 with w_row_off 0: attn_k_b stores W_uk_h transposed ([r, qk_nope] per head, w_head_rows
// r), attn_v_b stores W_uv_h ([v_head, r] per head, w_head_rows v_head). Tiled as moe_grouped_linear: MLA_TILE_M tokens by
// MLA_TILE_N outputs per block, so each weight element is read once per token tile.
extern "C" __global__ void mla_head_linear(
    const float* __restrict__ x,
    int x_ld,
    int x_head,
    int x_off,
    const void* __restrict__ w,
    int dtype,
    int w_cols,
    int w_head_rows,
    int w_row_off,
    int out_in,
    float* __restrict__ y,
    int y_ld,
    int y_head,
    int y_off,
    int n_tokens,
    int in_dim,
    int out_dim,
    float scale) {
    __shared__ float mla_x[MLA_TILE_M][MLA_TILE_K];
    __shared__ float mla_w[MLA_TILE_N][MLA_TILE_K + 1];
    const int t0 = blockIdx.x * MLA_TILE_M;
    const int head = blockIdx.y;
    const int o0 = blockIdx.z * MLA_TILE_N;
    const int tid = threadIdx.x;
    const int col = tid % MLA_TILE_N;
    const int row_group = tid / MLA_TILE_N;  // 4 groups of 4 tokens
    const long long w_row0 = (long long)head * w_head_rows + w_row_off;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < in_dim; k0 += MLA_TILE_K) {
        for (int i = tid; i < MLA_TILE_M * MLA_TILE_K; i += blockDim.x) {
            const int r = i / MLA_TILE_K;
            const int c = i % MLA_TILE_K;
            float v = 0.0f;
            if (t0 + r < n_tokens && k0 + c < in_dim) {
                v = x[(long long)(t0 + r) * x_ld + x_off + (long long)head * x_head + k0 + c];
            }
            mla_x[r][c] = v;
        }
        for (int i = tid; i < MLA_TILE_N * MLA_TILE_K; i += blockDim.x) {
            // Consecutive threads read consecutive stored elements in either orientation.
            int o, c;
            if (out_in) {
                o = i / MLA_TILE_K;
                c = i % MLA_TILE_K;
            } else {
                c = i / MLA_TILE_N;
                o = i % MLA_TILE_N;
            }
            float v = 0.0f;
            if (o0 + o < out_dim && k0 + c < in_dim) {
                const long long at = out_in ? (w_row0 + o0 + o) * w_cols + k0 + c
                                            : (w_row0 + k0 + c) * w_cols + o0 + o;
                v = moec_load(w, at, dtype);
            }
            mla_w[o][c] = v;
        }
        __syncthreads();
        for (int c = 0; c < MLA_TILE_K; ++c) {
            const float wv = mla_w[col][c];
            for (int j = 0; j < 4; ++j) {
                acc[j] += mla_x[row_group * 4 + j][c] * wv;
            }
        }
        __syncthreads();
    }
    const int o = o0 + col;
    if (o >= out_dim) {
        return;
    }
    for (int j = 0; j < 4; ++j) {
        const int t = t0 + row_group * 4 + j;
        if (t < n_tokens) {
            y[(long long)t * y_ld + y_off + (long long)head * y_head + o] = acc[j] * scale;
        }
    }
}

// Rotates the pair (a, b) by table entry i of `position`: a' = a c - b s, b' = b c + a s.
__device__ __forceinline__ void mla_rotate(
    float* a,
    float* b,
    const float* cos_table,
    const float* sin_table,
    int position,
    int half,
    int i) {
    const float c = cos_table[(size_t)position * half + i];
    const float s = sin_table[(size_t)position * half + i];
    const float x = *a;
    const float y = *b;
    *a = x * c - y * s;
    *b = y * c + x * s;
}

// Block (t, h < heads): head h's rotary query part, q[t, h * (nope + rope) + nope ..] rotated
// at positions[t], times q_scale, into qkv[t, h * head_dim + r ..]. Block (t, heads): the
// latent ckv[t, 0..r) RMS-normalised with kv_norm (eps) into K and V, k_pe = ckv[t, r..)
// rotated into K's last rope_dim columns, V's zeroed. The absorbed query columns
// qkv[t, h * head_dim + 0..r) are mla_head_linear's.
extern "C" __global__ void mla_qkv_rows(
    const float* __restrict__ q,
    const float* __restrict__ ckv,
    const void* __restrict__ kv_norm,
    int norm_dtype,
    const int* __restrict__ positions,
    const float* __restrict__ cos_table,
    const float* __restrict__ sin_table,
    float* __restrict__ qkv,
    int heads,
    int nope,
    int rope_dim,
    int r,
    int interleave,
    float q_scale,
    float eps) {
    const size_t t = blockIdx.x;
    const int head = blockIdx.y;
    const int head_dim = r + rope_dim;
    const int half = rope_dim / 2;
    const int position = positions[t];
    float* row = qkv + t * (size_t)(heads + 2) * head_dim;
    // Pair i of a rotary part: its two offsets inside the part.
    if (head < heads) {
        const float* src = q + t * (size_t)heads * (nope + rope_dim) + (size_t)head * (nope + rope_dim) + nope;
        float* dst = row + (size_t)head * head_dim + r;
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const int ia = interleave ? 2 * i : i;
            const int ib = interleave ? 2 * i + 1 : i + half;
            float a = src[ia];
            float b = src[ib];
            mla_rotate(&a, &b, cos_table, sin_table, position, half, i);
            dst[ia] = a * q_scale;
            dst[ib] = b * q_scale;
        }
        return;
    }
    const float* latent = ckv + t * (size_t)(r + rope_dim);
    float* k = row + (size_t)heads * head_dim;
    float* v = k + head_dim;
    // The latent normalised into K (the prelude's RMSNorm), then each thread copies the
    // values it wrote into V.
    moec_norm_row(latent, kv_norm, norm_dtype, k, r, eps, 0, blockDim.x);
    for (int i = threadIdx.x; i < r; i += blockDim.x) {
        v[i] = k[i];
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = interleave ? 2 * i : i;
        const int ib = interleave ? 2 * i + 1 : i + half;
        float a = latent[r + ia];
        float b = latent[r + ib];
        mla_rotate(&a, &b, cos_table, sin_table, position, half, i);
        k[r + ia] = a;
        k[r + ib] = b;
        v[r + ia] = 0.0f;
        v[r + ib] = 0.0f;
    }
}

// paged_prefill_attention's contract (prefill_attention.cu) for kv_heads = 1, the query
// heads split over gridDim.y groups of ceil(heads / gridDim.y) (DeepSeek-V3: 128 heads of
// 576 floats, past any block's shared memory), and value_dim: output columns past it are 0
// without reading V (MLA's V is [c | 0]: the rotary columns hold zeros). The body is
// paged_attention.cuh's moec_paged_attend, the prefill kernel's.
extern "C" __global__ void mla_paged_attention(
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
    int value_dim) {
    extern __shared__ float q_heads[];
    const int per_block = (heads + gridDim.y - 1) / gridDim.y;
    if (kv_heads != 1 || per_block > MLA_MAX_HEADS_PER_BLOCK) {
        return;
    }
    const int h0 = blockIdx.y * per_block;
    const int count = heads - h0 < per_block ? heads - h0 : per_block;
    if (count <= 0) {
        return;
    }
    const size_t row = blockIdx.x;
    const size_t seq = row_seq[row];
    moec_paged_attend(qkv, k_pool, v_pool, block_tables + seq * max_blocks, row, row_pos[row],
                      0, h0, count, q_heads, scores, out, heads, kv_heads, head_dim,
                      block_size, max_keys, sliding_window, scale, row_width, sink_col,
                      value_dim);
}
