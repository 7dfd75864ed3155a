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
// head_chunks, n_splits), block = MOEC_DECODE_THREADS (256) threads, dynamic shared memory
// = (2 * chunk * head_dim + 2 * g * head_dim + g * chunk + 3 * g) * sizeof(float) with
// g = min(group, MOEC_DECODE_MAX_GROUP) and chunk = moec_decode_chunk(head_dim) (4096 /
// head_dim keys, 2048 / head_dim past 128 dims, at most 128, a multiple of 4: under 48 KB
// for every head_dim <= 256). A block serves one sequence, one kv head and up to
// MOEC_DECODE_MAX_GROUP of its query heads (head_chunks = ceil(group / that)), so each key
// and value row is read once for the whole group (GQA), over split `blockIdx.z`'s
// split_keys keys of the attended span. It streams its keys in chunks through shared
// memory: all 256 threads load a chunk's K columns and V rows (float4 loads when head_dim
// and block_size are powers of two and the rows 16-byte aligned, else scalar rounds), the
// next chunk's loads issued before this chunk's arithmetic so they are in flight while it
// runs; then a thread a (head, key) computes the score (q . k over dim in order with fmaf,
// times scale: the CPU's key_scores_transposed order), warp g runs head g's online softmax
// (the running max and sum, the chunk's rescale), and a thread a (head, dim) output adds
// p * v key by key in order into the head's unnormalised output. With one split the
// block writes out; with several it writes its state (max, sum, unnormalised output) to
// `partials` and paged_decode_combine merges the splits: grid = (n_seqs, heads), block =
// (threads). partials is [n_seqs, heads, n_splits, 2] (max, sum) followed by [n_seqs,
// heads, n_splits, head_dim]; unused with one split (any valid pointer). The softmax's
// max and sums are merged as trees and expf is CUDA's, so outputs agree with the CPU to
// rounding, not bit for bit. The host (runtime::cuda::attention::decode_splits) runs one
// split up to 512 keys a row can hold and otherwise sizes the splits to fill the SMs.
//
// The token's own key and value are read from its qkv row, not the cache; with append = 1
// the blocks of split 0 and the first head chunk also write them into the pools
// (paged_kv_append's work, one launch fewer), which no block of the launch reads (nor any
// slot past the token's: a float4 of keys that holds them is read element by element).
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


#define MOEC_DECODE_THREADS 256
#define MOEC_DECODE_WARPS 8
#define MOEC_DECODE_MAX_GROUP 8
// Floats of one staged chunk of keys (and as many of values): chunk * head_dim.
#define MOEC_DECODE_CHUNK_FLOATS 4096
#define MOEC_DECODE_MAX_CHUNK 128

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

// Keys of a staged chunk for heads of head_dim dims (the host's `decode_chunk`): 4096 /
// head_dim (2048 / head_dim past 128 dims, so shared memory stays under 48 KB), at most 128,
// rounded down to a multiple of 4 (chunks start at positions that are multiples of 4, so a
// float4 of keys never crosses a KV block of a multiple of 4 slots). A power of two for
// power-of-two heads.
__device__ __forceinline__ int moec_decode_chunk(int head_dim) {
    const int c = (head_dim > 128 ? MOEC_DECODE_CHUNK_FLOATS / 2 : MOEC_DECODE_CHUNK_FLOATS) / head_dim;
    return (c > MOEC_DECODE_MAX_CHUNK ? MOEC_DECODE_MAX_CHUNK : c) & ~3;
}

// What a block stages: its sequence's table and own K/V row, its kv head, the span of
// absolute positions [lo, hi) its split attends (hi - 1 = pos for the last split), and the
// shared-memory chunk Ks [head_dim][chunk] (keys transposed, as in the cache) and
// Vs [chunk][head_dim]. The vector path (VW = 4) has head_dim, block_size and chunk powers
// of two and divides by shifts (`*_shift`).
struct MoecDecodeStage {
    const float* k_pool;
    const float* v_pool;
    const unsigned int* table;
    const float* own_k;
    const float* own_v;
    float* ks;
    float* vs;
    size_t head_tile;  // kv_head * block_size * head_dim: the head's tile within a block
    size_t block_stride;  // kv_heads * block_size * head_dim
    int block_size;
    int head_dim;
    int chunk;
    int pos;
    int lo;
    int hi;
    int bs_shift;
    int dim_shift;
    int chunk_shift;
};

__device__ __forceinline__ int moec_log2(int x) {
    int s = 0;
    while ((1 << s) < x) {
        ++s;
    }
    return s;
}

// Key e's K element of dim d (e in [lo, hi)): the token's own key from its qkv row (this
// launch writes its cache slot), the others from the cache.
__device__ __forceinline__ float moec_decode_k(const MoecDecodeStage& st, int e, int d) {
    return e == st.pos ? st.own_k[d]
                       : st.k_pool[(size_t)st.table[e / st.block_size] * st.block_stride +
                                   st.head_tile + (size_t)d * st.block_size + e % st.block_size];
}

// The vector path (float4 items): K item i is dim d = i / (chunk / 4) and keys
// p = c0 + 4 * (i % (chunk / 4)) .. p + 3 (Ks's floats [4 i, 4 i + 4)), V item i is key
// c0 + i / (head_dim / 4), dims 4 * (i % (head_dim / 4)) .. + 3 (Vs's floats [4 i, 4 i + 4)).
// A chunk has at most 1024 of each (chunk * head_dim <= 4096), MOEC_DECODE_KV_ITEMS per
// thread. Keys outside [lo, hi) are zeros, the token's own key and value come from its qkv
// row, and no cache slot past pos is read (nor pos's, which this launch writes): four
// cached keys inside the span are one float4, a vector at the span's edges or holding pos
// is read element by element (its keys share one KV block: block sizes are multiples of 4).
#define MOEC_DECODE_KV_ITEMS 4

__device__ __forceinline__ float4 moec_decode_fetch_k4(const MoecDecodeStage& st, int c0, int it) {
    const int d = it >> (st.chunk_shift - 2);
    const int p = c0 + ((it & ((st.chunk >> 2) - 1)) << 2);
    float4 x;
    x.x = x.y = x.z = x.w = 0.0f;
    if (p < st.hi && p + 3 >= st.lo) {
        const float* col = st.k_pool + (size_t)st.table[p >> st.bs_shift] * st.block_stride +
                           st.head_tile + ((size_t)d << st.bs_shift) + (p & (st.block_size - 1));
        if (p >= st.lo && p + 3 < st.pos) {
            x = *(const float4*)col;
        } else {
            float e4[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int e = p + t;
                e4[t] = e < st.lo || e >= st.hi ? 0.0f : e == st.pos ? st.own_k[d] : col[t];
            }
            x.x = e4[0];
            x.y = e4[1];
            x.z = e4[2];
            x.w = e4[3];
        }
    }
    return x;
}

__device__ __forceinline__ float4 moec_decode_fetch_v4(const MoecDecodeStage& st, int c0, int it) {
    const int e = c0 + (it >> (st.dim_shift - 2));
    float4 x;
    x.x = x.y = x.z = x.w = 0.0f;
    if (e >= st.lo && e < st.hi) {
        const float* row = e == st.pos ? st.own_v
                                       : st.v_pool + (size_t)st.table[e >> st.bs_shift] * st.block_stride +
                                             st.head_tile + ((size_t)(e & (st.block_size - 1)) << st.dim_shift);
        x = *(const float4*)(row + ((it & ((st.head_dim >> 2) - 1)) << 2));
    }
    return x;
}

// The vector path's loads of the chunk at c0 into registers, all in flight.
__device__ __forceinline__ void moec_decode_load4(const MoecDecodeStage& st, int c0,
                                                  float4 (&k)[MOEC_DECODE_KV_ITEMS],
                                                  float4 (&v)[MOEC_DECODE_KV_ITEMS]) {
    const int items = st.head_dim << (st.chunk_shift - 2);
#pragma unroll
    for (int r = 0; r < MOEC_DECODE_KV_ITEMS; ++r) {
        const int it = r * MOEC_DECODE_THREADS + (int)threadIdx.x;
        if (it < items) {
            k[r] = moec_decode_fetch_k4(st, c0, it);
            v[r] = moec_decode_fetch_v4(st, c0, it);
        }
    }
}

// The registers of moec_decode_load4 into shared memory.
__device__ __forceinline__ void moec_decode_store4(const MoecDecodeStage& st,
                                                   const float4 (&k)[MOEC_DECODE_KV_ITEMS],
                                                   const float4 (&v)[MOEC_DECODE_KV_ITEMS]) {
    const int items = st.head_dim << (st.chunk_shift - 2);
#pragma unroll
    for (int r = 0; r < MOEC_DECODE_KV_ITEMS; ++r) {
        const int it = r * MOEC_DECODE_THREADS + (int)threadIdx.x;
        if (it < items) {
            *(float4*)(st.ks + 4 * (size_t)it) = k[r];
            *(float4*)(st.vs + 4 * (size_t)it) = v[r];
        }
    }
}

// The scalar path (any head_dim and block size): the chunk's K floats (dim d, key c0 + j at
// Ks[d * chunk + j]) then its V floats, MOEC_DECODE_ROUND a thread in flight at a time.
#define MOEC_DECODE_ROUND 8

__device__ __forceinline__ void moec_decode_stage1(const MoecDecodeStage& st, int c0) {
    const int k_items = st.head_dim * st.chunk;
#pragma unroll 1
    for (int base = 0; base < 2 * k_items; base += MOEC_DECODE_ROUND * MOEC_DECODE_THREADS) {
        float x[MOEC_DECODE_ROUND];
#pragma unroll
        for (int r = 0; r < MOEC_DECODE_ROUND; ++r) {
            const int it = base + r * MOEC_DECODE_THREADS + (int)threadIdx.x;
            x[r] = 0.0f;
            if (it < k_items) {
                const int e = c0 + it % st.chunk;
                if (e >= st.lo && e < st.hi) {
                    x[r] = moec_decode_k(st, e, it / st.chunk);
                }
            } else if (it < 2 * k_items) {
                const int vi = it - k_items;
                const int e = c0 + vi / st.head_dim;
                if (e >= st.lo && e < st.hi) {
                    const float* row = e == st.pos ? st.own_v
                                                   : st.v_pool + (size_t)st.table[e / st.block_size] * st.block_stride +
                                                         st.head_tile + (size_t)(e % st.block_size) * st.head_dim;
                    x[r] = row[vi % st.head_dim];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MOEC_DECODE_ROUND; ++r) {
            const int it = base + r * MOEC_DECODE_THREADS + (int)threadIdx.x;
            if (it < 2 * k_items) {
                st.ks[it] = x[r];  // Vs follows Ks: V float vi at Ks + k_items + vi
            }
        }
    }
}

// One block of paged_decode_attention (read the header); VW: floats per staged vector (4
// when every vector is aligned, else 1).
template <int VW>
__device__ __forceinline__ void moec_paged_decode_block(
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
    const int k_begin = min(n_keys, (int)blockIdx.z * split_keys);
    const int k_end = min(n_keys, k_begin + split_keys);
    const float* row = qkv + seq * (size_t)row_width;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int chunk = moec_decode_chunk(head_dim);

    if (append && blockIdx.z == 0 && g0 == 0) {
        moec_paged_kv_append(qkv, k_pool, v_pool, table, seq, pos, kv_head, heads, kv_heads,
                             head_dim, block_size, row_width);
    }
    MoecDecodeStage st;
    st.k_pool = k_pool;
    st.v_pool = v_pool;
    st.table = table;
    st.own_k = row + (size_t)(heads + kv_head) * head_dim;
    st.own_v = row + (size_t)(heads + kv_heads + kv_head) * head_dim;
    st.ks = smem;
    st.vs = st.ks + (size_t)head_dim * chunk;
    st.head_tile = (size_t)kv_head * block_size * head_dim;
    st.block_stride = (size_t)kv_heads * block_size * head_dim;
    st.block_size = block_size;
    st.head_dim = head_dim;
    st.chunk = chunk;
    st.pos = pos;
    st.lo = start + k_begin;
    st.hi = start + k_end;
    st.bs_shift = moec_log2(block_size);
    st.dim_shift = moec_log2(head_dim);
    st.chunk_shift = moec_log2(chunk);
    // Shared memory after Ks and Vs: the group's queries [g_block][head_dim], the chunk's
    // scores, then probabilities [g_block][chunk], the unnormalised outputs
    // [g_block][head_dim] (output o belongs to thread o % 256), each head's rescale of this
    // chunk, and its final max and sum.
    float* q_sh = st.vs + (size_t)chunk * head_dim;
    float* p_sh = q_sh + (size_t)g_block * head_dim;
    float* acc_sh = p_sh + (size_t)g_block * chunk;
    float* alpha_sh = acc_sh + (size_t)g_block * head_dim;
    float* m_sh = alpha_sh + g_block;
    float* l_sh = m_sh + g_block;
    for (int i = threadIdx.x; i < gn * head_dim; i += MOEC_DECODE_THREADS) {
        q_sh[i] = row[(size_t)first_head * head_dim + i];
        acc_sh[i] = 0.0f;
    }

    // Warp g < gn keeps head g's running max and sum.
    float m_run = neg_inf;
    float l_run = 0.0f;
    const int c_first = st.lo & ~3;
    const int n_chunks = st.hi > st.lo ? (st.hi - c_first + chunk - 1) / chunk : 0;
    // The vector path issues the next chunk's loads before this chunk's arithmetic, so they
    // are in flight while it runs (one load site: iteration c stores chunk c - 1's loads).
    float4 kr[MOEC_DECODE_KV_ITEMS];
    float4 vr[MOEC_DECODE_KV_ITEMS];
#pragma unroll 1
    for (int c = VW == 4 ? -1 : 0; c < n_chunks; ++c) {
        const int c0 = c_first + c * chunk;
        if (VW == 4) {
            if (c >= 0) {
                moec_decode_store4(st, kr, vr);
            }
            if (c + 1 < n_chunks) {
                moec_decode_load4(st, c0 + chunk, kr, vr);
            }
            if (c < 0) {
                continue;
            }
        } else {
            moec_decode_stage1(st, c0);
        }
        __syncthreads();
        // Scores of the chunk's keys in [lo, hi) (q . k over dims in order with fmaf, times
        // scale: the CPU's key_scores_transposed order); -inf for the others.
#pragma unroll 1
        for (int i = threadIdx.x; i < gn * chunk; i += MOEC_DECODE_THREADS) {
            const int g = i / chunk;
            const int j = i - g * chunk;
            const int e = c0 + j;
            float s = neg_inf;
            if (e >= st.lo && e < st.hi) {
                float a = 0.0f;
                const float* q = q_sh + (size_t)g * head_dim;
#pragma unroll 8
                for (int d = 0; d < head_dim; ++d) {
                    a = fmaf(q[d], st.ks[(size_t)d * chunk + j], a);
                }
                s = a * scale;
            }
            p_sh[i] = s;
        }
        __syncthreads();
        // Online softmax, warp g for head g: the chunk's max joins the running max, the
        // earlier sum and outputs are rescaled to it (alpha), p = exp(score - max).
        if (warp < gn) {
            float* p = p_sh + (size_t)warp * chunk;
            float cmax = neg_inf;
            for (int j = lane; j < chunk; j += 32) {
                cmax = fmaxf(cmax, p[j]);
            }
            const float m_new = fmaxf(m_run, moec_warp_max(cmax));
            const float alpha = moec_merge_weight(m_run, m_new);
            float sum = 0.0f;
            for (int j = lane; j < chunk; j += 32) {
                const float e = moec_merge_weight(p[j], m_new);
                p[j] = e;
                sum += e;
            }
            l_run = l_run * alpha + moec_warp_sum(sum);
            m_run = m_new;
            if (lane == 0) {
                alpha_sh[warp] = alpha;
            }
        }
        __syncthreads();
        // Outputs: p . v over the chunk's keys in [lo, hi), key by key in order.
        const int j_lo = max(st.lo - c0, 0);
        const int j_hi = min(st.hi - c0, chunk);
#pragma unroll 1
        for (int o = threadIdx.x; o < gn * head_dim; o += MOEC_DECODE_THREADS) {
            const int g = o / head_dim;
            const int d = o - g * head_dim;
            const float* p = p_sh + (size_t)g * chunk;
            const float* v = st.vs + d;
            float a = acc_sh[o] * alpha_sh[g];
#pragma unroll 4
            for (int j = j_lo; j < j_hi; ++j) {
                a = fmaf(p[j], v[(size_t)j * head_dim], a);
            }
            acc_sh[o] = a;
        }
        __syncthreads();
    }
    if (warp < gn && lane == 0) {
        m_sh[warp] = m_run;
        l_sh[warp] = l_run;
    }
    __syncthreads();
    const int n_splits = gridDim.z;
#pragma unroll 1
    for (int o = threadIdx.x; o < gn * head_dim; o += MOEC_DECODE_THREADS) {
        const int g = o / head_dim;
        const int d = o - g * head_dim;
        const int head = first_head + g;
        const float m = m_sh[g];
        const float l = l_sh[g];
        float a = acc_sh[o];
        if (n_splits == 1) {
            // gpt-oss: the head's sink logit joins the max and the denominator.
            float sum = l;
            if (sink_col >= 0) {
                const float sink = row[sink_col + head];
                const float mx = fmaxf(m, sink);
                const float w = moec_merge_weight(m, mx);
                a *= w;
                sum = l * w + expf(sink - mx);
            }
            out[(seq * heads + head) * (size_t)head_dim + d] = a / sum;
        } else {
            const size_t state = (seq * heads + head) * (size_t)n_splits + blockIdx.z;
            if (d == 0) {
                partials[2 * state] = m;
                partials[2 * state + 1] = l;
            }
            const size_t states = (size_t)gridDim.x * heads * n_splits;
            partials[2 * states + state * head_dim + d] = a;
        }
    }
}

// Two blocks an SM (at most 128 registers a thread), so a batch's blocks overlap.
#ifdef __CUDACC_RTC__
#define MOEC_DECODE_BOUNDS __launch_bounds__(MOEC_DECODE_THREADS, 2)
#else
#define MOEC_DECODE_BOUNDS  // the CPU emulation (kernels/cpu_emulation/shim.h)
#endif
extern "C" __global__ void MOEC_DECODE_BOUNDS paged_decode_attention(
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
    extern __shared__ float decode_smem[];
    // float4 staging: whole vectors of dims and of keys (head_dim and block_size multiples
    // of 4), and every row they start in 16-byte aligned (pools, qkv rows).
    const bool vec = head_dim >= 4 && (head_dim & (head_dim - 1)) == 0 && block_size >= 4 &&
                     (block_size & (block_size - 1)) == 0 && row_width % 4 == 0 &&
                     (((unsigned long long)k_pool | (unsigned long long)v_pool |
                       (unsigned long long)qkv) % 16) == 0;
#define MOEC_DECODE_BLOCK(VW)                                                                 \
    moec_paged_decode_block<VW>(qkv, k_pool, v_pool, block_tables, context_lens, partials,   \
                                out, decode_smem, heads, kv_heads, head_dim, block_size,      \
                                max_blocks, split_keys, sliding_window, scale, row_width,     \
                                sink_col, append)
    if (vec) {
        MOEC_DECODE_BLOCK(4);
    } else {
        MOEC_DECODE_BLOCK(1);
    }
#undef MOEC_DECODE_BLOCK
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
