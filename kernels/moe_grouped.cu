// MoE on the device: tokens grouped per expert and the experts' FFNs as grouped GEMMs over
// device-side segment offsets, so a layer's routed experts cost a fixed number of launches
// whatever the routing, and the host never reads the routing.
//
//   moe_group            the route's (token, slot) entries of the member experts, grouped by
//                        expert (count, prefix sum, permute; stable, as Routing::by_expert),
//                        and the tiles of at most MOE_TILE_M positions of one expert that
//                        moe_grouped_linear runs
//   moe_grouped_linear   y[p] = x[row(p)] . W_e^T (+ b_e) for every grouped position p of each
//                        expert e, bf16/f16/f32 or ggml-block weights read as stored (blocks
//                        decoded into the shared-memory tile), f32 activations and
//                        f32 accumulation; epilogues: store, SwiGLU into the gate product
//                        (silu(y) * acc, swiglu.cu's formula), or weight * (acc + b) scattered
//                        into the slot buffer (scatter_weighted's)
//
// Layouts: `route` is backend::decode_routing's ([n_entries] pairs of an expert u32 and its
// f32 weight's bits; entry i is token i / top_k, slot i % top_k). Weight tables are one
// device u64 address per expert (0: not a member of the task's set / no bias), every
// expert's matrix stored alike (dtype 0 bf16, 1 f16, 2 f32, or ggml blocks 3 Q8_0, 4 Q4_K,
// 5 Q5_K, 6 Q6_K decoded inside the product by the prelude's moec_quant_load; `out_in` 1: [out, in]
// row-major, 0: [in, out]); a null bias table means no biases. `tiles` = [n_tiles, n_positions, then (expert, first position,
// rows) per tile]. Grouped activations are [position, width] f32 rows.
// Launch: moe_group: grid 1, block 256 (experts <= 256). moe_grouped_linear: grid
// (max tiles, ceil(out / MOE_TILE_N)), block 256; blocks past the tile count return, so the
// host sizes the grid for the worst case without reading anything back.

#define MOE_MAX_EXPERTS 256
#define MOE_TILE_M 16
#define MOE_TILE_N 64
#define MOE_TILE_K 32

extern "C" __global__ void moe_group(
    const unsigned int* __restrict__ route,
    const unsigned long long* __restrict__ members,
    unsigned int* __restrict__ perm_row,
    unsigned int* __restrict__ perm_slot,
    float* __restrict__ perm_weight,
    int* __restrict__ tiles,
    long long n_entries,
    int top_k,
    int experts) {
    __shared__ int moe_counts[MOE_MAX_EXPERTS];
    __shared__ int moe_offsets[MOE_MAX_EXPERTS + 1];
    // One thread per expert scans the route: no atomics, and each expert's positions keep
    // the route's (token, slot) order, so the result does not depend on thread timing.
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int count = 0;
        if (members[e] != 0) {
            for (long long i = 0; i < n_entries; ++i) {
                count += route[2 * i] == (unsigned int)e;
            }
        }
        moe_counts[e] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int position = 0;
        int n_tiles = 0;
        for (int e = 0; e < experts; ++e) {
            moe_offsets[e] = position;
            for (int first = 0; first < moe_counts[e]; first += MOE_TILE_M) {
                const int rest = moe_counts[e] - first;
                tiles[2 + 3 * n_tiles] = e;
                tiles[2 + 3 * n_tiles + 1] = position + first;
                tiles[2 + 3 * n_tiles + 2] = rest < MOE_TILE_M ? rest : MOE_TILE_M;
                ++n_tiles;
            }
            position += moe_counts[e];
        }
        moe_offsets[experts] = position;
        tiles[0] = n_tiles;
        tiles[1] = position;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        if (moe_counts[e] == 0) {
            continue;
        }
        int position = moe_offsets[e];
        for (long long i = 0; i < n_entries; ++i) {
            if (route[2 * i] == (unsigned int)e) {
                perm_row[position] = (unsigned int)(i / top_k);
                perm_slot[position] = (unsigned int)(i % top_k);
                perm_weight[position] = __uint_as_float(route[2 * i + 1]);
                ++position;
            }
        }
    }
}

// mode 0: y[p, o] = acc + b[o]
// mode 1: y[p, o] = silu(y[p, o]) * (acc + b[o])         (y holds the gate product)
// mode 2: slots[row(p), slot(p), o] = weight(p) * (acc + b[o])
// `gather` 1: x row of position p is x[perm_row[p]] (the layer's normalised tokens);
// 0: x[p] (a grouped activation).
extern "C" __global__ void moe_grouped_linear(
    const float* __restrict__ x,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ biases,
    float* __restrict__ y,
    int gather,
    int mode,
    int in_dim,
    int out_dim,
    int dtype,
    int out_in,
    int bias_dtype,
    int top_k) {
    __shared__ float moe_x[MOE_TILE_M][MOE_TILE_K];
    __shared__ float moe_w[MOE_TILE_N][MOE_TILE_K + 1];
    const int tile = blockIdx.x;
    if (tile >= tiles[0]) {
        return;
    }
    const int expert = tiles[2 + 3 * tile];
    const int first = tiles[2 + 3 * tile + 1];
    const int rows = tiles[2 + 3 * tile + 2];
    const void* w = (const void*)weights[expert];
    const int o0 = blockIdx.y * MOE_TILE_N;
    const int tid = threadIdx.x;
    const int col = tid % MOE_TILE_N;
    const int row_group = tid / MOE_TILE_N;  // 4 groups of 4 rows
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < in_dim; k0 += MOE_TILE_K) {
        for (int i = tid; i < MOE_TILE_M * MOE_TILE_K; i += blockDim.x) {
            const int r = i / MOE_TILE_K;
            const int c = i % MOE_TILE_K;
            float v = 0.0f;
            if (r < rows && k0 + c < in_dim) {
                const long long src = gather ? (long long)perm_row[first + r] : (long long)(first + r);
                v = x[src * in_dim + k0 + c];
            }
            moe_x[r][c] = v;
        }
        for (int i = tid; i < MOE_TILE_N * MOE_TILE_K; i += blockDim.x) {
            // Consecutive threads read consecutive stored elements in either orientation.
            int o, c;
            if (out_in) {
                o = i / MOE_TILE_K;
                c = i % MOE_TILE_K;
            } else {
                c = i / MOE_TILE_N;
                o = i % MOE_TILE_N;
            }
            float v = 0.0f;
            if (o0 + o < out_dim && k0 + c < in_dim) {
                const long long at = out_in ? (long long)(o0 + o) * in_dim + k0 + c
                                            : (long long)(k0 + c) * out_dim + o0 + o;
                v = moec_load(w, at, dtype);
            }
            moe_w[o][c] = v;
        }
        __syncthreads();
        for (int c = 0; c < MOE_TILE_K; ++c) {
            const float wv = moe_w[col][c];
            for (int j = 0; j < 4; ++j) {
                acc[j] += moe_x[row_group * 4 + j][c] * wv;
            }
        }
        __syncthreads();
    }
    const int o = o0 + col;
    if (o >= out_dim) {
        return;
    }
    const unsigned long long b = biases != 0 ? biases[expert] : 0ull;
    const float bias = b != 0 ? moec_load((const void*)b, o, bias_dtype) : 0.0f;
    for (int j = 0; j < 4; ++j) {
        const int r = row_group * 4 + j;
        if (r >= rows) {
            continue;
        }
        const long long p = first + r;
        const float v = acc[j] + bias;
        if (mode == 0) {
            y[p * out_dim + o] = v;
        } else if (mode == 1) {
            const float g = y[p * out_dim + o];
            y[p * out_dim + o] = g / (1.0f + expf(-g)) * v;
        } else {
            const long long to = ((long long)perm_row[p] * top_k + perm_slot[p]) * out_dim + o;
            y[to] = perm_weight[p] * v;
        }
    }
}

// The few-row form of moe_grouped_linear (decode, small prefills): one warp per (tile,
// output feature), the lanes striding over the input features with 16-byte weight loads,
// each lane keeping one partial sum per tile row, then a warp reduction. Every weight is
// read once per tile and the launch has tiles x out warps, so a decode step's projection is
// bandwidth-bound instead of waiting on the tiled kernel's long serial K loop over few
// blocks. Same arguments, tiles and epilogues as moe_grouped_linear; only `out_in` 1
// weights (rows are outputs: a warp reads one contiguous row).
// Launch: grid (max tiles, ceil(out / MOE_GEMV_WARPS)), block 32 * MOE_GEMV_WARPS.
#define MOE_GEMV_WARPS 8

// Eight Q4_K weights e0 .. e0 + 7 (e0 a multiple of 8) of the block at b, which is 4-byte
// aligned: moec_quant_decode's values (the same scale, min and rounded products) from
// word loads instead of 20 byte loads, the bytes picked out of registers.
__device__ __forceinline__ void moec_q4k_decode8_words(const unsigned char* b, int e0, float* v) {
    const int j = e0 / 32;
    const unsigned int dm = *(const unsigned int*)b;
    const unsigned int s0 = *(const unsigned int*)(b + 4);
    const unsigned int s1 = *(const unsigned int*)(b + 8);
    const unsigned int s2 = *(const unsigned int*)(b + 12);
    // Byte n (0..12) of the packed scales out of the three words (n is known per lane only
    // at run time, so no local array to index).
    int sc, m;
    moec_scale_min_k4(
        j,
        [s0, s1, s2](int n) { return ((n < 4 ? s0 : (n < 8 ? s1 : s2)) >> (8 * (n & 3))) & 0xffu; },
        &sc,
        &m);
    const float scale = __fmul_rn(moec_f16_to_f32((unsigned short)(dm & 0xffffu)), (float)sc);
    const float min = __fmul_rn(moec_f16_to_f32((unsigned short)(dm >> 16)), (float)m);
    const unsigned char* qs = b + 16 + 32 * (j / 2) + e0 % 32;
    const unsigned int q[2] = {*(const unsigned int*)qs, *(const unsigned int*)(qs + 4)};
    const int shift = 4 * (j % 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int code = (int)((q[i / 4] >> (8 * (i % 4) + shift)) & 0x0fu);
        v[i] = __fsub_rn(__fmul_rn(scale, (float)code), min);
    }
}

// Eight weights i .. i + 7 (i a multiple of 8) of a matrix in format DT, known when the
// kernel is compiled, so the block size divides by a constant and the format's branch is
// the only code left. `aligned`: the matrix starts on a 16-byte boundary (then every Q4_K
// block, 144 bytes, starts on one too).
template <int DT>
__device__ __forceinline__ void moe_load8(const void* base, long long i, bool aligned, float* v) {
    if (DT == 4 && aligned) {
        moec_q4k_decode8_words((const unsigned char*)base + (i / 256) * 144, (int)(i % 256), v);
        return;
    }
    if (DT >= 3) {
        moec_quant_load(base, i, DT, 8, v);
        return;
    }
    const int dtype = DT;
    if (dtype == 2) {
        const float4 a = *(const float4*)((const float*)base + i);
        const float4 b = *(const float4*)((const float*)base + i + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    const uint4 raw = *(const uint4*)((const unsigned short*)base + i);
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int j = 0; j < 4; ++j) {
        const unsigned short lo = (unsigned short)(words[j] & 0xffffu);
        const unsigned short hi = (unsigned short)(words[j] >> 16);
        v[2 * j] = dtype == 0 ? moec_bf16_to_f32(lo) : moec_f16_to_f32(lo);
        v[2 * j + 1] = dtype == 0 ? moec_bf16_to_f32(hi) : moec_f16_to_f32(hi);
    }
}

// The dot products of stored row `row` of `w` (format `dtype`) with up to MOE_TILE_M
// activation rows x + src[r], r < rows, over `in_dim` inputs, each lane striding over the
// inputs (16-byte weight loads where the row starts and `x` allow) and the partial sums
// reduced across the warp: lane r (< rows) gets row r's sum. Every lane of the warp calls
// it with the same `rows`.
template <int DT>
__device__ float moe_warp_rows_dot_t(const void* w, long long row, const float* x,
                                     const long long* src, int rows, int in_dim, int lane) {
    const int dtype = DT;
    const bool aligned = (unsigned long long)w % 16 == 0;
    float acc[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        acc[r] = 0.0f;
    }
    // 16-byte loads need 8-element alignment of every row start (in_dim % 8 == 0) and of
    // the matrix itself; otherwise one element at a time. Quantised rows are whole blocks
    // (multiples of 32 weights) read bytewise, 8 weights of one sub-block per lane and step.
    const bool vec = (in_dim % 8 == 0) && (dtype >= 3 || aligned)
                     && ((unsigned long long)x % 16 == 0);
    if (vec) {
        for (int k = lane * 8; k < in_dim; k += 256) {
            float wv[8];
            moe_load8<DT>(w, row + k, aligned, wv);
#pragma unroll
            for (int r = 0; r < MOE_TILE_M; ++r) {
                if (r < rows) {
                    const float4 a = *(const float4*)(x + src[r] + k);
                    const float4 b = *(const float4*)(x + src[r] + k + 4);
                    acc[r] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                            + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
                }
            }
        }
    } else {
        for (int k = lane; k < in_dim; k += 32) {
            const float wv = moec_load(w, row + k, dtype);
#pragma unroll
            for (int r = 0; r < MOE_TILE_M; ++r) {
                if (r < rows) {
                    acc[r] += wv * x[src[r] + k];
                }
            }
        }
    }
    // `rows` is the same for the whole warp, so every lane takes the same branches.
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        if (r < rows) {
            for (int off = 16; off > 0; off >>= 1) {
                acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
            }
        }
    }
    // Lane r takes row r's sum, acc[lane], picked without dynamic register indexing.
    float v = 0.0f;
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        if (r == lane) {
            v = acc[r];
        }
    }
    return v;
}

// moe_warp_rows_dot_t for the format code `dtype` (prelude.cuh's codes 0-9): one copy of
// the loop per format, so no lane decodes through a run-time switch or divides by a
// run-time block size. The products are those of the generic loop, bit for bit.
__device__ float moe_warp_rows_dot(const void* w, long long row, int dtype, const float* x,
                                   const long long* src, int rows, int in_dim, int lane) {
    switch (dtype) {
    case 0: return moe_warp_rows_dot_t<0>(w, row, x, src, rows, in_dim, lane);
    case 1: return moe_warp_rows_dot_t<1>(w, row, x, src, rows, in_dim, lane);
    case 2: return moe_warp_rows_dot_t<2>(w, row, x, src, rows, in_dim, lane);
    case 3: return moe_warp_rows_dot_t<3>(w, row, x, src, rows, in_dim, lane);
    case 4: return moe_warp_rows_dot_t<4>(w, row, x, src, rows, in_dim, lane);
    case 5: return moe_warp_rows_dot_t<5>(w, row, x, src, rows, in_dim, lane);
    case 6: return moe_warp_rows_dot_t<6>(w, row, x, src, rows, in_dim, lane);
    case 7: return moe_warp_rows_dot_t<7>(w, row, x, src, rows, in_dim, lane);
    case 8: return moe_warp_rows_dot_t<8>(w, row, x, src, rows, in_dim, lane);
    default: return moe_warp_rows_dot_t<9>(w, row, x, src, rows, in_dim, lane);
    }
}

extern "C" __global__ void moe_grouped_gemv(
    const float* __restrict__ x,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ biases,
    float* __restrict__ y,
    int gather,
    int mode,
    int in_dim,
    int out_dim,
    int dtype,
    int out_in,
    int bias_dtype,
    int top_k) {
    const int tile = blockIdx.x;
    if (tile >= tiles[0]) {
        return;
    }
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.y * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (o >= out_dim) {
        return;
    }
    const int expert = tiles[2 + 3 * tile];
    const int first = tiles[2 + 3 * tile + 1];
    const int rows = tiles[2 + 3 * tile + 2];
    const void* w = (const void*)weights[expert];
    long long src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        const int p = first + (r < rows ? r : 0);
        src[r] = (gather ? (long long)perm_row[p] : (long long)p) * in_dim;
    }
    float v = moe_warp_rows_dot(w, (long long)o * in_dim, dtype, x, src, rows, in_dim, lane);
    if (lane >= rows) {
        return;
    }
    const unsigned long long b = biases != 0 ? biases[expert] : 0ull;
    v += b != 0 ? moec_load((const void*)b, o, bias_dtype) : 0.0f;
    const long long p = first + lane;
    if (mode == 0) {
        y[p * out_dim + o] = v;
    } else if (mode == 1) {
        const float g = y[p * out_dim + o];
        y[p * out_dim + o] = g / (1.0f + expf(-g)) * v;
    } else {
        const long long to = ((long long)perm_row[p] * top_k + perm_slot[p]) * out_dim + o;
        y[to] = perm_weight[p] * v;
    }
}

// The few-row dense projection (a decode step's q|k|v, o, router, shared expert and head
// with at most MOE_TILE_M tokens): y[r, o] (=|+=) x[r] . W[o] for r < n, bf16/f16/f32 or
// ggml-block (dtype 3-6, decoded 8 weights a lane inside the product) weights stored [out, in] read once with 16-byte loads, f32 activations and accumulation,
// one warp per output feature. One launch where the cuBLAS path takes three (split the
// activations into a bf16 pair, the GEMM, sum the halves) and two scratch buffers. `y`
// rows are `ldy` floats apart; `accumulate` adds to them (a residual).
// Launch: grid ceil(out / MOE_GEMV_WARPS), block 32 * MOE_GEMV_WARPS.
extern "C" __global__ void linear_gemv(
    const float* __restrict__ x,
    const void* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (o >= out_dim) {
        return;
    }
    const int rows = n < MOE_TILE_M ? n : MOE_TILE_M;
    long long src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        src[r] = (long long)(r < rows ? r : 0) * in_dim;
    }
    const float v = moe_warp_rows_dot(w, (long long)o * in_dim, dtype, x, src, rows, in_dim, lane);
    if (lane >= rows) {
        return;
    }
    float* out = y + (long long)lane * ldy + o;
    *out = accumulate ? *out + v : v;
}
