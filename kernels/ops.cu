// The data-movement and small ops of the op catalog that are not a GEMM, with the CPU
// backend's layouts (src/math/*):
//   embed_bf16 / embed_f16 / embed_f32   embed: head::embed, out[t] = widen(table[ids[t]])
//   widen_bf16 / widen_f16               stored weights to f32 (simd::widen), for f32 GEMMs
//   narrow_bf16                          f32 to bf16, round to nearest even (half's from_f32)
//   add_in_place                         residual adds: dst += src (o_proj_residual)
//   clamp_in_place                       DBRX's clip_qkv: x = clamp(x, -limit, limit), NaN kept
//   gather_rows                          an expert's routed rows into a contiguous block
//   scatter_weighted                     weight * y into each (row, slot) of the slot buffer
//   combine_slots                        moe::combine_shared: residual += slots summed by
//                                        expert (+ the shared expert's row)
//   argmax_rows                          greedy sampling: sampling::argmax per row
//   route_pack / route_experts           the `route` buffer's layout (backend::decode_routing):
//                                        per (token, slot) an expert u32 then its f32 weight
//   split_bf16 / sum_halves              f32 activations as a bf16 pair (hi, lo) for a bf16
//                                        GEMM with f32 accumulation, and the pair's products
//                                        summed (into a strided, optionally accumulated output)
//
// Layouts: activations are f32 rows [n, width], row-major. Stored tensors (embedding,
// weights) are passed as their raw element bits: bf16 and f16 as unsigned short (NVRTC has
// no cuda_bf16.h/cuda_fp16.h without the toolkit). Token ids and routing indices are
// unsigned int. The slot buffer is [n_tokens, top_k, width] (moe.rs); routing experts are
// [n_tokens, top_k]. Counts of elements are long long so pools over 2^31 elements work.
// Launch: embed/gather/scatter/combine/argmax: grid = (rows), block = (threads) striding
// over the row; argmax's threads must be a power of two. widen/narrow/add: any 1-D grid,
// grid-stride loop.
// The caller keeps ids below vocab, rows below n_tokens and slots below top_k (the CPU
// kernels check the same and report errors; the host has the ids before the launch).

extern "C" __global__ void embed_bf16(
    const unsigned short* __restrict__ table,
    const unsigned int* __restrict__ ids,
    float* __restrict__ out,
    int hidden) {
    const size_t token = blockIdx.x;
    const unsigned short* row = table + (size_t)ids[token] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[token * hidden + i] = moec_bf16_to_f32(row[i]);
    }
}

extern "C" __global__ void embed_f16(
    const unsigned short* __restrict__ table,
    const unsigned int* __restrict__ ids,
    float* __restrict__ out,
    int hidden) {
    const size_t token = blockIdx.x;
    const unsigned short* row = table + (size_t)ids[token] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[token * hidden + i] = moec_f16_to_f32(row[i]);
    }
}

extern "C" __global__ void embed_f32(
    const float* __restrict__ table,
    const unsigned int* __restrict__ ids,
    float* __restrict__ out,
    int hidden) {
    const size_t token = blockIdx.x;
    const float* row = table + (size_t)ids[token] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[token * hidden + i] = row[i];
    }
}

extern "C" __global__ void widen_bf16(const unsigned short* __restrict__ src, float* __restrict__ dst, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = moec_bf16_to_f32(src[i]);
    }
}

extern "C" __global__ void widen_f16(const unsigned short* __restrict__ src, float* __restrict__ dst, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] = moec_f16_to_f32(src[i]);
    }
}

// Round to nearest, ties to even; NaN stays NaN (quiet bit set), as half::bf16::from_f32.
extern "C" __global__ void narrow_bf16(const float* __restrict__ src, unsigned short* __restrict__ dst, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int x = __float_as_uint(src[i]);
        unsigned int out;
        if ((x & 0x7fffffffu) > 0x7f800000u) {
            out = (x >> 16) | 0x40u;
        } else if ((x & 0x8000u) != 0 && (x & 0x17fffu) != 0) {
            out = (x >> 16) + 1;
        } else {
            out = x >> 16;
        }
        dst[i] = (unsigned short)out;
    }
}

extern "C" __global__ void add_in_place(float* __restrict__ dst, const float* __restrict__ src, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        dst[i] += src[i];
    }
}

// x = clamp(x, -limit, limit) as f32::clamp in projection::pre_attn: NaN stays NaN (the
// comparisons are false), unlike fminf/fmaxf which would replace it.
extern "C" __global__ void clamp_in_place(float* __restrict__ x, float limit, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = x[i];
        x[i] = v < -limit ? -limit : (v > limit ? limit : v);
    }
}

// dst[i] = src[rows[i]] for the n_rows (= gridDim.x) rows routed to one expert.
extern "C" __global__ void gather_rows(
    const float* __restrict__ src,
    const unsigned int* __restrict__ rows,
    float* __restrict__ dst,
    int width) {
    const size_t i = blockIdx.x;
    const float* from = src + (size_t)rows[i] * width;
    for (int d = threadIdx.x; d < width; d += blockDim.x) {
        dst[i * width + d] = from[d];
    }
}

// slots[rows[i], slot_of[i]] = weights[i] * y[i] for the expert's n_rows (= gridDim.x) rows.
extern "C" __global__ void scatter_weighted(
    const float* __restrict__ y,
    const unsigned int* __restrict__ rows,
    const unsigned int* __restrict__ slot_of,
    const float* __restrict__ weights,
    float* __restrict__ slots,
    int top_k,
    int width) {
    const size_t i = blockIdx.x;
    const float w = weights[i];
    float* to = slots + ((size_t)rows[i] * top_k + slot_of[i]) * width;
    for (int d = threadIdx.x; d < width; d += blockDim.x) {
        to[d] = w * y[i * width + d];
    }
}

#define OPS_MAX_TOP_K 64

// route[2i] = experts[i], route[2i + 1] = the bits of weights[i], for n (token, slot) entries.
extern "C" __global__ void route_pack(
    const unsigned int* __restrict__ experts,
    const float* __restrict__ weights,
    unsigned int* __restrict__ route,
    long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        route[2 * i] = experts[i];
        route[2 * i + 1] = __float_as_uint(weights[i]);
    }
}

// experts[i] = route[2i]: the expert indices of n (token, slot) entries of a `route` buffer.
extern "C" __global__ void route_experts(const unsigned int* __restrict__ route, unsigned int* __restrict__ experts, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        experts[i] = route[2 * i];
    }
}

// Round to nearest even as narrow_bf16 (NaN kept quiet).
__device__ __forceinline__ unsigned short ops_f32_to_bf16(float value) {
    const unsigned int x = __float_as_uint(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x40u);
    }
    if ((x & 0x8000u) != 0 && (x & 0x17fffu) != 0) {
        return (unsigned short)((x >> 16) + 1);
    }
    return (unsigned short)(x >> 16);
}

// out = [hi | lo], each n bf16: hi = bf16(x), lo = bf16(x - hi). hi + lo carries 16 of the
// 24 significant bits of x (relative error <= 2^-17), so a bf16 GEMM of the pair with f32
// accumulation agrees with the CPU's f32-activation product to ~1e-5, not to bf16's 4e-3.
extern "C" __global__ void split_bf16(const float* __restrict__ x, unsigned short* __restrict__ out, long long n) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = x[i];
        const unsigned short hi = ops_f32_to_bf16(v);
        out[i] = hi;
        out[n + i] = ops_f32_to_bf16(v - moec_bf16_to_f32(hi));
    }
}

// c is a column-major [rows, 2 * cols] product of the pair [hi | lo]: for column t < cols
// dst[t * ldd + i] = (accumulate ? dst[t * ldd + i] : 0) + (c[t][i] + c[cols + t][i]).
// Launch: grid = (cols, any y: the y blocks split each row), block = (threads) striding over rows.
extern "C" __global__ void sum_halves(
    const float* __restrict__ c,
    float* __restrict__ dst,
    int rows,
    int cols,
    int ldd,
    int accumulate) {
    const size_t t = blockIdx.x;
    const float* hi = c + t * (size_t)rows;
    const float* lo = c + ((size_t)cols + t) * (size_t)rows;
    float* to = dst + t * (size_t)ldd;
    // Blocks along y split the row (a vocabulary head's 32k-200k outputs: one block per
    // row took 57 us on an H200).
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < rows; i += blockDim.x * gridDim.y) {
        const float v = hi[i] + lo[i];
        to[i] = accumulate ? to[i] + v : v;
    }
}

// residual[t] += sum of the token's top_k slots taken in ascending (expert, slot) order,
// starting from zero, plus the shared expert's row when `shared` is not null (Qwen2-MoE,
// [n_tokens, width]): moe::combine_shared's order, so the sums are bit-identical to the
// CPU's. Grid (tokens, any y): the y blocks split the row (a batch-1 step's one token on
// one block walked 1024 values four deep: 8 us on an H200). At top_k <= 8 a thread loads
// its slots' values, the residual and the experts before it sorts (one memory round trip,
// not three: the order needs the experts, the values do not), then sums in that order.
#define OPS_FAST_TOP_K 8
extern "C" __global__ void combine_slots(
    const float* __restrict__ slots,
    const unsigned int* __restrict__ experts,
    const float* __restrict__ shared,
    float* __restrict__ residual,
    int top_k,
    int width,
    int expert_stride) {
    const size_t t = blockIdx.x;
    if (top_k > OPS_MAX_TOP_K) {
        return;
    }
    const int stride = blockDim.x * gridDim.y;
    const int first = blockIdx.y * blockDim.x + threadIdx.x;
    // The token's experts, `expert_stride` words apart (1: an experts array; 2: the packed
    // route read in place, no route_experts launch).
    if (top_k <= OPS_FAST_TOP_K) {
        unsigned int e[OPS_FAST_TOP_K];
#pragma unroll
        for (int s = 0; s < OPS_FAST_TOP_K; ++s) {
            e[s] = s < top_k ? experts[(t * top_k + s) * (size_t)expert_stride] : 0u;
        }
        for (int d = first; d < width; d += stride) {
            float v[OPS_FAST_TOP_K];
#pragma unroll
            for (int s = 0; s < OPS_FAST_TOP_K; ++s) {
                v[s] = s < top_k ? slots[(t * top_k + s) * width + d] : 0.0f;
            }
            const float add = shared != 0 ? shared[t * width + d] : 0.0f;
            const float r = residual[t * width + d];
            // Slot s's place in the (expert, slot) order: the slots before it.
            int rank[OPS_FAST_TOP_K];
#pragma unroll
            for (int s = 0; s < OPS_FAST_TOP_K; ++s) {
                int before = 0;
#pragma unroll
                for (int q = 0; q < OPS_FAST_TOP_K; ++q) {
                    before += q < top_k && (e[q] < e[s] || (e[q] == e[s] && q < s));
                }
                rank[s] = before;
            }
            // Summed in that order from zero, picked without dynamic register indexing.
            float sum = 0.0f;
            for (int a = 0; a < top_k; ++a) {
                float pick = 0.0f;
#pragma unroll
                for (int s = 0; s < OPS_FAST_TOP_K; ++s) {
                    if (s < top_k && rank[s] == a) {
                        pick = v[s];
                    }
                }
                sum += pick;
            }
            if (shared != 0) {
                sum += add;
            }
            residual[t * width + d] = r + sum;
        }
        return;
    }
    unsigned int chosen[OPS_MAX_TOP_K];
    for (int s = 0; s < top_k; ++s) {
        chosen[s] = experts[(t * top_k + s) * (size_t)expert_stride];
    }
    int order[OPS_MAX_TOP_K];
    for (int s = 0; s < top_k; ++s) {
        order[s] = s;
    }
    // Insertion sort by (expert, slot): k is small.
    for (int a = 1; a < top_k; ++a) {
        const int s = order[a];
        int b = a - 1;
        while (b >= 0 && (chosen[order[b]] > chosen[s] || (chosen[order[b]] == chosen[s] && order[b] > s))) {
            order[b + 1] = order[b];
            --b;
        }
        order[b + 1] = s;
    }
    for (int d = first; d < width; d += stride) {
        float sum = 0.0f;
        for (int s = 0; s < top_k; ++s) {
            sum += slots[(t * top_k + order[s]) * width + d];
        }
        if (shared != 0) {
            sum += shared[t * width + d];
        }
        residual[t * width + d] += sum;
    }
}

// The better of two (logit, index) candidates of argmax_rows: the larger value, the lower
// index on ties (values are never NaN here: a NaN never becomes a candidate).
__device__ __forceinline__ void ops_argmax_take(float& value, unsigned int& index, float v,
                                                unsigned int i) {
    if (v > value || (v == value && i < index)) {
        value = v;
        index = i;
    }
}

// (value, index) reduced over the warp with ops_argmax_take; every lane gets the result.
__device__ __forceinline__ void ops_argmax_warp(float& value, unsigned int& index) {
    for (int off = 16; off > 0; off >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, value, off);
        const unsigned int i = __float_as_uint(__shfl_xor_sync(0xffffffffu, __uint_as_float(index), off));
        ops_argmax_take(value, index, v, i);
    }
}

// out[r] = index of the largest logit of row r, the lowest index on ties (sampling::argmax).
// NaN logits never win; a row with no comparable logit gives 0. The maximum under that
// order does not depend on the order of comparisons, so the threads' loads are batched:
// eight 16-byte loads a thread in flight before any compare (32k logits: one round trip
// at 1024 threads; the one-load-at-a-time scan was a chain of 31 dependent loads, 16 us
// on an H200), then warp shuffles and one pass over the warps' winners.
// Launch: grid (rows), block a multiple of 32 up to 1024.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, unsigned int* __restrict__ out, int vocab) {
    __shared__ float best_value[32];
    __shared__ unsigned int best_index[32];
    const size_t row = blockIdx.x;
    const float* values = logits + row * (size_t)vocab;
    float value = __int_as_float(0xff800000); // -inf
    unsigned int index = 0xffffffffu;
    const int threads = blockDim.x;
    const int tid = threadIdx.x;
    // 16-byte loads when the row starts on 16 bytes; the rest (or all) one float at a time.
    const int n4 = (unsigned long long)values % 16 == 0 ? vocab / 4 : 0;
    const float4* v4 = (const float4*)values;
    for (int base = 0; base < n4; base += 8 * threads) {
        float4 q[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * threads + tid;
            if (i < n4) {
                q[u] = v4[i];
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * threads + tid;
            if (i < n4) {
                ops_argmax_take(value, index, q[u].x, 4u * i);
                ops_argmax_take(value, index, q[u].y, 4u * i + 1);
                ops_argmax_take(value, index, q[u].z, 4u * i + 2);
                ops_argmax_take(value, index, q[u].w, 4u * i + 3);
            }
        }
    }
    for (int base = 4 * n4; base < vocab; base += 8 * threads) {
        float q[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * threads + tid;
            q[u] = i < vocab ? values[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * threads + tid;
            if (i < vocab) {
                ops_argmax_take(value, index, q[u], (unsigned int)i);
            }
        }
    }
    ops_argmax_warp(value, index);
    if ((tid & 31) == 0) {
        best_value[tid >> 5] = value;
        best_index[tid >> 5] = index;
    }
    __syncthreads();
    if (tid < 32) {
        const int warps = (threads + 31) >> 5;
        value = tid < warps ? best_value[tid] : __int_as_float(0xff800000);
        index = tid < warps ? best_index[tid] : 0xffffffffu;
        ops_argmax_warp(value, index);
        if (tid == 0) {
            out[row] = index == 0xffffffffu ? 0u : index;
        }
    }
}

// Many small copies in one launch (DeviceMemory::copy_runs): `runs` holds n (offset,
// length) pairs in bytes; run i copies src[offset, offset + length) to the same offsets of
// dst. Either side may be page-locked host memory mapped into the device's address space
// (a KV cache's context between the pinned and gpu arenas). 16-byte moves where both ends
// and the length allow, else 4-byte, else bytes.
// Work split (issue 44: a KV cache's appended keys are head_dim runs of a few bytes per
// head and sequence, thousands a copy, and a whole 256-thread block per run left all but
// one thread idle): a block takes its warps' count of consecutive runs; each run of at
// most COPY_RUNS_SMALL bytes is copied by one warp, each longer run by the whole block
// with up to four 16-byte loads a thread in flight before their stores (over the mapped
// pinned arena every load is a PCIe round trip). Runs are disjoint, so the two phases
// need no barrier between them.
// Launch: grid min(ceil(n / (block / 32)), 65535) (blocks stride over the groups), block a
// multiple of 32 (256).
#define COPY_RUNS_SMALL 512ull

__device__ __forceinline__ void copy_runs_span(
    const char* __restrict__ s,
    char* __restrict__ d,
    unsigned long long len,
    unsigned int lane,
    unsigned int width) {
    const unsigned long long align = (unsigned long long)s | (unsigned long long)d | len;
    if (align % 16 == 0) {
        const uint4* s16 = (const uint4*)s;
        uint4* d16 = (uint4*)d;
        const unsigned long long n16 = len / 16;
        unsigned long long j = lane;
        for (; j + 3ull * width < n16; j += 4ull * width) {
            const uint4 a = s16[j];
            const uint4 b = s16[j + width];
            const uint4 c = s16[j + 2ull * width];
            const uint4 e = s16[j + 3ull * width];
            d16[j] = a;
            d16[j + width] = b;
            d16[j + 2ull * width] = c;
            d16[j + 3ull * width] = e;
        }
        for (; j < n16; j += width) {
            d16[j] = s16[j];
        }
    } else if (align % 4 == 0) {
        const unsigned int* s4 = (const unsigned int*)s;
        unsigned int* d4 = (unsigned int*)d;
        for (unsigned long long j = lane; j < len / 4; j += width) {
            d4[j] = s4[j];
        }
    } else {
        for (unsigned long long j = lane; j < len; j += width) {
            d[j] = s[j];
        }
    }
}

extern "C" __global__ void copy_runs(
    const unsigned long long* __restrict__ runs,
    long long n,
    const char* __restrict__ src,
    char* __restrict__ dst) {
    const long long per = (long long)(blockDim.x >> 5) > 0 ? (long long)(blockDim.x >> 5) : 1;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int lane = threadIdx.x & 31;
    for (long long g = (long long)blockIdx.x * per; g < n; g += (long long)gridDim.x * per) {
        // Phase 1: each warp its own short run.
        const long long mine = g + warp;
        if ((long long)warp < per && mine < n) {
            const unsigned long long at = runs[2 * mine];
            const unsigned long long len = runs[2 * mine + 1];
            if (len <= COPY_RUNS_SMALL) {
                copy_runs_span(src + at, dst + at, len, lane, 32);
            }
        }
        // Phase 2: the group's long runs, one after another, by the whole block.
        const long long last = g + per < n ? g + per : n;
        for (long long i = g; i < last; ++i) {
            const unsigned long long at = runs[2 * i];
            const unsigned long long len = runs[2 * i + 1];
            if (len > COPY_RUNS_SMALL) {
                copy_runs_span(src + at, dst + at, len, threadIdx.x, blockDim.x);
            }
        }
    }
}
