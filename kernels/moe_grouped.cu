// MoE on the device: tokens grouped per expert and the experts' FFNs as grouped GEMMs over
// device-side segment offsets, so a layer's routed experts cost a fixed number of launches
// whatever the routing, and the host never reads the routing.
//
//   moe_group            the route's (token, slot) entries of the member experts, grouped by
//                        expert (count, prefix sum, permute; stable, as Routing::by_expert),
//                        and the tiles of at most MOE_TILE_M positions of one expert that
//                        moe_grouped_linear runs (warp scans, at the end of the file;
//                        moe_group_block: one thread per expert, MOEC_FLOAT_KERNELS=block)
//   moe_count_experts    after moe_group: adds the experts that got positions to a stream's
//                        pair of counters (every expert computation; those computed from a
//                        format copy of their expert), read by the host after each step
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

#include "router.cuh"
#include "tensor_core.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_TILE_M 16
#define MOE_TILE_N 64
#define MOE_TILE_K 32
// Warps a block of the few-row kernels (moe_grouped_gemv and the linear_gemv family).
#define MOE_GEMV_WARPS 8
// moe_grouped_mma: warps a block (each 16 outputs of the tile), the inputs staged per step,
// and the staged rows' stride in bf16 elements (a multiple of 8, as wmma's loads need;
// the 8 extra spread the rows over the shared-memory banks).
#define MOE_MMA_WARPS 4
#define MOE_MMA_N (16 * MOE_MMA_WARPS)
#define MOE_MMA_K 64
#define MOE_MMA_LD (MOE_MMA_K + 8)

extern "C" __global__ void moe_group_block(
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
    // Exclusive prefix sums of the counts and of the tiles per expert over the block
    // (Hillis-Steele over the experts, log2(experts) steps, each thread owning experts t,
    // t + blockDim, ...), so no thread walks every expert: every expert's tiles are written
    // by its own thread after the scan. (One thread walked them all before.)
    __shared__ int moe_tiles_of[MOE_MAX_EXPERTS];
    __shared__ int moe_tile_offsets[MOE_MAX_EXPERTS];
    __shared__ int moe_scan_a[MOE_MAX_EXPERTS];
    __shared__ int moe_scan_b[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const int c = moe_counts[e];
        moe_tiles_of[e] = (c + MOE_TILE_M - 1) / MOE_TILE_M;
        moe_offsets[e] = c;
        moe_tile_offsets[e] = moe_tiles_of[e];
    }
    __syncthreads();
    for (int step = 1; step < experts; step <<= 1) {
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            moe_scan_a[e] = moe_offsets[e] + (e >= step ? moe_offsets[e - step] : 0);
            moe_scan_b[e] = moe_tile_offsets[e] + (e >= step ? moe_tile_offsets[e - step] : 0);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            moe_offsets[e] = moe_scan_a[e];
            moe_tile_offsets[e] = moe_scan_b[e];
        }
        __syncthreads();
    }
    // Inclusive sums to exclusive: the totals are the last slot's.
    const int total_positions = experts > 0 ? moe_offsets[experts - 1] : 0;
    const int total_tiles = experts > 0 ? moe_tile_offsets[experts - 1] : 0;
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const int c = moe_counts[e];
        moe_scan_a[e] = moe_offsets[e] - c;
        moe_scan_b[e] = moe_tile_offsets[e] - moe_tiles_of[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        moe_offsets[e] = moe_scan_a[e];
        const int position = moe_scan_a[e];
        const int tile0 = moe_scan_b[e];
        for (int t = 0; t < moe_tiles_of[e]; ++t) {
            const int first = t * MOE_TILE_M;
            const int rest = moe_counts[e] - first;
            tiles[2 + 3 * (tile0 + t)] = e;
            tiles[2 + 3 * (tile0 + t) + 1] = position + first;
            tiles[2 + 3 * (tile0 + t) + 2] = rest < MOE_TILE_M ? rest : MOE_TILE_M;
        }
    }
    if (threadIdx.x == 0) {
        moe_offsets[experts] = total_positions;
        tiles[0] = total_tiles;
        tiles[1] = total_positions;
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

// Adds to counts[0] the experts `tiles` (moe_group's) gives positions, and to counts[1]
// the same when `substituted` is 1 (the group's experts are format copies): the run
// report's count of expert computations, one per expert that got tokens, as the CPU
// backend counts them. An expert's tiles are consecutive, in expert order (moe_group lays
// them out by the prefix sum over experts), so an expert starts where the tile's expert
// changes. One thread: `counts` is the launching stream's own pair and a stream's launches
// run in order, so nothing else writes it meanwhile (no atomics).
extern "C" __global__ void moe_count_experts(
    const int* __restrict__ tiles,
    unsigned long long* __restrict__ counts,
    int substituted) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const int n_tiles = tiles[0];
    unsigned long long experts = 0;
    for (int t = 0; t < n_tiles; ++t) {
        if (t == 0 || tiles[2 + 3 * t] != tiles[2 + 3 * (t - 1)]) {
            ++experts;
        }
    }
    counts[0] += experts;
    if (substituted != 0) {
        counts[1] += experts;
    }
}

// The grouped kernels' epilogue at grouped position p and output o, given the product `v`
// (its bias added) and, in mode 3, the up product `up`:
//   0: y[p, o] = v
//   1: y[p, o] = silu(y[p, o]) * v                      (y holds the gate product)
//   2: slots[row(p), slot(p), o] = weight(p) * v        (scatter_weighted's)
//   3: y[p, o] = silu(v) * up                           (gate, up and SwiGLU in one launch)
// with swiglu.cu's formula.
__device__ __forceinline__ void moe_store(float* y, long long p, int o, int out_dim, int mode,
                                          float v, float up, const unsigned int* perm_row,
                                          const unsigned int* perm_slot,
                                          const float* perm_weight, int top_k) {
    if (mode == 3) {
        y[p * out_dim + o] = v / (1.0f + expf(-v)) * up;
    } else if (mode == 0) {
        y[p * out_dim + o] = v;
    } else if (mode == 1) {
        const float g = y[p * out_dim + o];
        y[p * out_dim + o] = g / (1.0f + expf(-g)) * v;
    } else {
        const long long to = ((long long)perm_row[p] * top_k + perm_slot[p]) * out_dim + o;
        y[to] = perm_weight[p] * v;
    }
}

// What a warp of the few-row grouped kernels (a warp per (tile, output feature), grid (max
// tiles, ceil(out / MOE_GEMV_WARPS))) works on: its tile's expert, first position and rows,
// its output and lane. False when the block's tile is past the tile count or the warp's
// output past out_dim: the caller returns.
struct MoeWarpTile {
    int expert;
    int first;
    int rows;
    int o;
    int lane;
};

__device__ __forceinline__ bool moe_warp_tile(const int* tiles, int out_dim, MoeWarpTile& t) {
    const int tile = blockIdx.x;
    if (tile >= tiles[0]) {
        return false;
    }
    t.lane = threadIdx.x & 31;
    t.o = blockIdx.y * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (t.o >= out_dim) {
        return false;
    }
    t.expert = tiles[2 + 3 * tile];
    t.first = tiles[2 + 3 * tile + 1];
    t.rows = tiles[2 + 3 * tile + 2];
    return true;
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
        moe_store(y, first + r, o, out_dim, mode, acc[j] + bias, 0.0f, perm_row, perm_slot,
                  perm_weight, top_k);
    }
}

// The few-row form of moe_grouped_linear (decode, small prefills): one warp per (tile,
// output feature), the lanes striding over the input features with 16-byte weight loads,
// each lane keeping one partial sum per tile row, then a warp reduction. Every weight is
// read once per tile and the launch has tiles x out warps, so a decode step's projection is
// bandwidth-bound instead of waiting on the tiled kernel's long serial K loop over few
// blocks. Same arguments, tiles and epilogues as moe_grouped_linear plus `weights2` and
// mode 3: y[p, o] = silu(x . gate_e[o]) * (x . up_e[o]) with `weights` the gate table and
// `weights2` the up table (no biases), gate, up and SwiGLU in one launch; only `out_in` 1
// weights (rows are outputs: a warp reads one contiguous row).
// Launch: grid (max tiles, ceil(out / MOE_GEMV_WARPS)), block 32 * MOE_GEMV_WARPS.

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
// it with the same `rows`. NORM: each activation is first normalised as rms_norm writes it,
// nw[k] * (x * scale[r]) with the norm weight `nw` (format `nw_code`) and row r's RMSNorm
// scale (moec_norm_row's), so a projection of normalised rows needs no rms_norm launch
// and gets that launch's values, bit for bit.
template <int DT, bool NORM = false>
__device__ float moe_warp_rows_dot_t(const void* w, long long row, const float* x,
                                     const long long* src, int rows, int in_dim, int lane,
                                     const void* nw = 0, int nw_code = 0,
                                     const float* scale = 0) {
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
        // One 16-byte weight load a lane and step, as first written: an H200 run (ab22ec2)
        // measured four loads a lane in flight (decoded to 8 floats each, so 32 weight
        // registers next to 16 accumulators) at 2x this loop's time for a 3584-wide down
        // projection and slower at 16 rows, so the loop stays one load deep.
        for (int k = lane * 8; k < in_dim; k += 256) {
            float wv[8];
            moe_load8<DT>(w, row + k, aligned, wv);
            float nv[8];
            if (NORM) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    nv[j] = moec_load(nw, k + j, nw_code);
                }
            }
#pragma unroll
            for (int r = 0; r < MOE_TILE_M; ++r) {
                if (r < rows) {
                    float4 a = *(const float4*)(x + src[r] + k);
                    float4 b = *(const float4*)(x + src[r] + k + 4);
                    if (NORM) {
                        const float s = scale[r];
                        a.x = nv[0] * (a.x * s);
                        a.y = nv[1] * (a.y * s);
                        a.z = nv[2] * (a.z * s);
                        a.w = nv[3] * (a.w * s);
                        b.x = nv[4] * (b.x * s);
                        b.y = nv[5] * (b.y * s);
                        b.z = nv[6] * (b.z * s);
                        b.w = nv[7] * (b.w * s);
                    }
                    acc[r] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                            + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
                }
            }
        }
    } else {
        for (int k = lane; k < in_dim; k += 32) {
            const float wv = moec_load(w, row + k, dtype);
            const float nv = NORM ? moec_load(nw, k, nw_code) : 0.0f;
#pragma unroll
            for (int r = 0; r < MOE_TILE_M; ++r) {
                if (r < rows) {
                    const float a = x[src[r] + k];
                    acc[r] += wv * (NORM ? nv * (a * scale[r]) : a);
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
    const unsigned long long* __restrict__ weights2,
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
    MoeWarpTile t;
    if (!moe_warp_tile(tiles, out_dim, t)) {
        return;
    }
    const int expert = t.expert, first = t.first, rows = t.rows, o = t.o, lane = t.lane;
    const void* w = (const void*)weights[expert];
    long long src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        const int p = first + (r < rows ? r : 0);
        src[r] = (gather ? (long long)perm_row[p] : (long long)p) * in_dim;
    }
    float v = moe_warp_rows_dot(w, (long long)o * in_dim, dtype, x, src, rows, in_dim, lane);
    float up = 0.0f;
    if (mode == 3) {
        // Gate and up in one launch: the same x rows (in L1 after the gate's pass), the
        // up row right after, and the activation written once.
        up = moe_warp_rows_dot((const void*)weights2[expert], (long long)o * in_dim, dtype, x,
                               src, rows, in_dim, lane);
    }
    if (lane >= rows) {
        return;
    }
    const unsigned long long b = biases != 0 ? biases[expert] : 0ull;
    v += b != 0 ? moec_load((const void*)b, o, bias_dtype) : 0.0f;
    moe_store(y, first + lane, o, out_dim, mode, v, up, perm_row, perm_slot, perm_weight, top_k);
}

// ---- Tensor-core expert products ---------------------------------------------------------
// moe_grouped_gemv on tensor cores (kernels/tensor_core.cuh) for bf16 experts with many
// rows per expert (a batch-16/64 decode step, a prefill): each block takes one of
// moe_group's tiles (at most MOE_TILE_M = 16 grouped positions of one expert: the tile's
// M) and MOE_MMA_N outputs, each warp 16 of them; every MOE_MMA_K inputs it stages the
// tile's activation rows as bf16 pairs (moec_split_bf16: hi + lo, so the products keep
// f32 activations' precision to 2^-17, as the cuBLAS path's split_bf16 does) and the
// weight rows as stored (bf16 bits, 16-byte loads where the rows allow), then multiplies
// 16x16x16 tiles with f32 accumulation, both halves into one accumulator. Rows past the
// tile's and inputs/outputs past in_dim/out_dim are staged as zeros, so any in_dim and
// out_dim work (tails included); a warp whose 16 outputs are all past out_dim multiplies
// zeros and stores nothing.
// Same arguments, tables, tiles and epilogues as moe_grouped_gemv (modes 0-3; mode 3:
// gate (`weights`) and up (`weights2`) in one launch, two accumulators, silu(gate) * up
// written once; biases in modes 0-2), but only bf16 weights stored [out, in] (dtype 0,
// out_in 1: the host chooses this kernel only for those; `dtype` and `out_in` are
// accepted for the shared argument list). The sums are f32 sums of exact products in the
// tensor cores' order, not moe_grouped_gemv's bits.
// Launch: grid (max tiles, ceil(out / MOE_MMA_N)), block 32 * MOE_MMA_WARPS.
extern "C" __global__ void moe_grouped_mma(
    const float* __restrict__ x,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ weights2,
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
    // Staged activations (hi, lo) and weights (gate or the only matrix, up), then each
    // warp's accumulators stored for the epilogue.
    __shared__ __align__(32) unsigned short mma_x[2][MOE_TILE_M * MOE_MMA_LD];
    __shared__ __align__(32) unsigned short mma_w[2][MOE_MMA_N * MOE_MMA_LD];
    __shared__ __align__(32) float mma_out[MOE_MMA_WARPS][2][MOE_TILE_M * 16];
    const int tile = blockIdx.x;
    if (tile >= tiles[0]) {
        return;
    }
    const int expert = tiles[2 + 3 * tile];
    const int first = tiles[2 + 3 * tile + 1];
    const int rows = tiles[2 + 3 * tile + 2];
    const int mats = mode == 3 ? 2 : 1;
    const unsigned short* w[2] = {
        (const unsigned short*)weights[expert],
        mode == 3 ? (const unsigned short*)weights2[expert] : (const unsigned short*)0,
    };
    const int o0 = blockIdx.y * MOE_MMA_N;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    // 16-byte weight loads need every row start on 16 bytes: in_dim % 8 == 0 and the
    // matrices aligned (the host passes 16-byte aligned tables; checked here per matrix).
    bool vec = in_dim % 8 == 0;
    for (int m = 0; m < mats; ++m) {
        vec = vec && (unsigned long long)w[m] % 16 == 0;
    }
    // Gate (or the only product) and up accumulators, named apart so they stay registers.
    MoecMmaAcc acc_g, acc_u;
    moec_mma_zero(acc_g);
    moec_mma_zero(acc_u);
    for (int k0 = 0; k0 < in_dim; k0 += MOE_MMA_K) {
        // Activations: 16 rows x MOE_MMA_K, a thread 8 consecutive inputs of one row.
        for (int i = tid; i < MOE_TILE_M * (MOE_MMA_K / 8); i += blockDim.x) {
            const int r = i / (MOE_MMA_K / 8);
            const int c = (i % (MOE_MMA_K / 8)) * 8;
            const int p = first + (r < rows ? r : 0);
            const float* xr = x + (gather ? (long long)perm_row[p] : (long long)p) * in_dim;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int k = k0 + c + j;
                const float v = r < rows && k < in_dim ? xr[k] : 0.0f;
                moec_split_bf16(v, &mma_x[0][r * MOE_MMA_LD + c + j],
                                &mma_x[1][r * MOE_MMA_LD + c + j]);
            }
        }
        // Weights: MOE_MMA_N rows x MOE_MMA_K per matrix, a thread 8 consecutive inputs of
        // one output row (one 16-byte load when the 8 are inside the row and aligned).
        for (int i = tid; i < mats * MOE_MMA_N * (MOE_MMA_K / 8); i += blockDim.x) {
            const int m = i / (MOE_MMA_N * (MOE_MMA_K / 8));
            const int rest = i % (MOE_MMA_N * (MOE_MMA_K / 8));
            const int o = rest / (MOE_MMA_K / 8);
            const int c = (rest % (MOE_MMA_K / 8)) * 8;
            const int k = k0 + c;
            unsigned short* dst = &mma_w[m][o * MOE_MMA_LD + c];
            const long long row = (long long)(o0 + o) * in_dim;
            if (o0 + o < out_dim && vec && k + 8 <= in_dim) {
                const uint4 raw = *(const uint4*)(w[m] + row + k);
                const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    dst[2 * j] = (unsigned short)(words[j] & 0xffffu);
                    dst[2 * j + 1] = (unsigned short)(words[j] >> 16);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    dst[j] = o0 + o < out_dim && k + j < in_dim ? w[m][row + k + j]
                                                                : (unsigned short)0;
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MOE_MMA_K; kk += 16) {
            MoecMmaAB hi, lo, b;
            moec_mma_load_a(hi, &mma_x[0][kk], MOE_MMA_LD);
            moec_mma_load_a(lo, &mma_x[1][kk], MOE_MMA_LD);
            moec_mma_load_b(b, &mma_w[0][warp * 16 * MOE_MMA_LD + kk], MOE_MMA_LD);
            moec_mma(acc_g, hi, b);
            moec_mma(acc_g, lo, b);
            if (mats == 2) {
                moec_mma_load_b(b, &mma_w[1][warp * 16 * MOE_MMA_LD + kk], MOE_MMA_LD);
                moec_mma(acc_u, hi, b);
                moec_mma(acc_u, lo, b);
            }
        }
        __syncthreads();
    }
    moec_mma_store(&mma_out[warp][0][0], acc_g, 16);
    if (mats == 2) {
        moec_mma_store(&mma_out[warp][1][0], acc_u, 16);
    }
    // Each lane reads back elements of its own warp's stored tile: every lane of the warp
    // stored it (warp-collective), and a barrier orders the stores before the reads.
    __syncthreads();
    const unsigned long long b = biases != 0 ? biases[expert] : 0ull;
    for (int i = lane; i < MOE_TILE_M * 16; i += 32) {
        const int r = i / 16;
        const int o = o0 + warp * 16 + i % 16;
        if (r >= rows || o >= out_dim) {
            continue;
        }
        float v = mma_out[warp][0][i];
        const float up = mode == 3 ? mma_out[warp][1][i] : 0.0f;
        if (mode != 3 && b != 0) {
            v += moec_load((const void*)b, o, bias_dtype);
        }
        moe_store(y, first + r, o, out_dim, mode, v, up, perm_row, perm_slot, perm_weight,
                  top_k);
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

// One value per virtual warp (p[w], w < warps <= 8: the partial sums of threads 32 w +
// lane of a block) summed as moec_block_reduce sums a block's values: each warp's xor
// tree, then warp 0's xor tree over the warps' results (zeros past them). Every lane gets
// the total, that reduction's bits, from one warp and no barrier.
__device__ __forceinline__ float moe_warp_block_sum(const float* p, int warps, int lane) {
    float part = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        if (w < warps) {
            float v = p[w];
            for (int off = 16; off > 0; off /= 2) {
                v = v + __shfl_xor_sync(0xffffffffu, v, off);
            }
            if (lane == w) {
                part = v;
            }
        }
    }
    for (int off = 16; off > 0; off /= 2) {
        part = part + __shfl_xor_sync(0xffffffffu, part, off);
    }
    return part;
}

// moec_norm_row's scale (and LayerNorm's mean into *mean when `layer_norm`) of the row at
// `src` as a block of `threads` threads (a multiple of 32, at most 256: row_block's sizes)
// computes it, bit for bit, by one warp: lane l plays threads l, l + 32, ..., each one's
// values summed in that thread's order, then moe_warp_block_sum. The loads are laid out
// 8 virtual threads a step, so a lane has up to 8 in flight. Every lane of the warp calls
// it (shuffles); every lane gets the result.
__device__ float moe_warp_norm(const float* src, int d, float eps, int layer_norm, int threads,
                               int lane, float* mean_out) {
    const int warps = threads >> 5;
    float p[8];
    float mean = 0.0f;
    if (layer_norm) {
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            p[w] = 0.0f;
        }
        for (int j = lane; j < d; j += threads) {
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                const int i = j + 32 * w;
                if (w < warps && i < d) {
                    p[w] += src[i];
                }
            }
        }
        mean = moe_warp_block_sum(p, warps, lane) / (float)d;
    }
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        p[w] = 0.0f;
    }
#pragma unroll 4
    for (int j = lane; j < d; j += threads) {
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const int i = j + 32 * w;
            if (w < warps && i < d) {
                const float v = layer_norm ? src[i] - mean : src[i];
                p[w] += v * v;
            }
        }
    }
    if (mean_out != 0) {
        *mean_out = mean;
    }
    return 1.0f / sqrtf(moe_warp_block_sum(p, warps, lane) / (float)d + eps);
}

// Up to three few-row projections of the same rows x in one launch (q, k and v of a
// layer's normalised rows): outputs [0, out0) are W0's, then out1 of W1's, then out2 of
// W2's, each matrix in its own format (d0, d1, d2: prelude codes), written to y at
// columns 0, col1 and col2 of rows `ldy` floats apart; as linear_gemv otherwise (a warp per
// output, the same products bit for bit). With `norm_w` not null the rows are RMSNorm'd
// first (weight `norm_w` of format `norm_code`, `eps`; the values rms_norm launched with
// `norm_threads` threads a block writes, bit for bit), so a layer's attention norm needs no
// launch of its own; then the weights must be float (codes 0-2). Launch: grid ceil((out0 +
// out1 + out2) / MOE_GEMV_WARPS), block 32 * MOE_GEMV_WARPS; norm_threads <= 256.
extern "C" __global__ void linear_gemv3(
    const float* __restrict__ x,
    const void* __restrict__ w0,
    const void* __restrict__ w1,
    const void* __restrict__ w2,
    int out0,
    int out1,
    int out2,
    int d0,
    int d1,
    int d2,
    float* __restrict__ y,
    int n,
    int in_dim,
    int ldy,
    int col1,
    int col2,
    const void* __restrict__ norm_w,
    int norm_code,
    float eps,
    int norm_threads) {
    const int lane = threadIdx.x & 31;
    const int rows = n < MOE_TILE_M ? n : MOE_TILE_M;
    // With a norm weight every block first takes each row's RMSNorm scale, as rms_norm at
    // `norm_threads` threads a block computes it (every thread takes part, so before any
    // returns), and the products normalise their inputs as they read them.
    // The rows' scales are taken by the warps in turn (warp w: rows w, w + warps, ...;
    // moe_warp_norm, rms_norm's bits), one barrier in all: the whole block taking each row
    // with two barriers a row made the block's start grow with the rows (16 rows: 16
    // serial block reductions in each of the 192 blocks of a q|k|v).
    __shared__ float scale[MOE_TILE_M];
    if (norm_w != 0) {
        for (int r = threadIdx.x >> 5; r < rows; r += blockDim.x >> 5) {
            const float s = moe_warp_norm(x + (long long)r * in_dim, in_dim, eps, 0, norm_threads,
                                          lane, 0);
            if (lane == 0) {
                scale[r] = s;
            }
        }
        __syncthreads();
    }
    int o = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    const void* w = w0;
    int dtype = d0;
    int col = 0;
    if (o >= out0) {
        o -= out0;
        w = w1;
        dtype = d1;
        col = col1;
        if (o >= out1) {
            o -= out1;
            w = w2;
            dtype = d2;
            col = col2;
            if (o >= out2) {
                return;
            }
        }
    }
    long long src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        src[r] = (long long)(r < rows ? r : 0) * in_dim;
    }
    const long long at = (long long)o * in_dim;
    float v;
    if (norm_w == 0) {
        v = moe_warp_rows_dot(w, at, dtype, x, src, rows, in_dim, lane);
    } else if (dtype == 0) {
        v = moe_warp_rows_dot_t<0, true>(w, at, x, src, rows, in_dim, lane, norm_w, norm_code, scale);
    } else if (dtype == 1) {
        v = moe_warp_rows_dot_t<1, true>(w, at, x, src, rows, in_dim, lane, norm_w, norm_code, scale);
    } else {
        v = moe_warp_rows_dot_t<2, true>(w, at, x, src, rows, in_dim, lane, norm_w, norm_code, scale);
    }
    if (lane >= rows) {
        return;
    }
    y[(long long)lane * ldy + col + o] = v;
}

// ---- Integer products on 8-bit activations -----------------------------------------------
// The few-row products of block-quantised weights (Q8_0, Q4_K, Q5_K, Q6_K) with activation
// rows quantised once by activations_q8.cu's q8_quantize (codes and a scale per weight
// block: Q8_K for the K-quants, Q8_0 for Q8_0): the block arithmetic of the CPU's
// quantised product (src/math/qmatmul/dot.rs) with the codes multiplied four at a time
// (__dp4a), as llama.cpp's mmvq does. Each lane takes whole "units" of a block (Q4_K/Q5_K:
// 32 weights of two sub-blocks from one 16-byte load; Q6_K: 16 weights from three 4-byte
// loads; Q8_0: 8 weights), sums its units' integer parts and turns each unit into f32 with
// the block's scales: value = (dx dy) f32(isum) - (dmin dy) f32(imin) (Q4_K/Q5_K), (dx dy)
// f32(isum) (Q6_K, Q8_0). The integers are the CPU's per sub-block; the f32 sums are taken
// per unit and across lanes, not per block in order, so results agree with the CPU's to
// f32 rounding of the sum (not bit for bit). Weights are read once per tile of rows.
// Alignment: every matrix starts on 16 bytes (the host checks; Q4_K/Q5_K blocks, 144 and
// 176 bytes, then all start on 16; Q6_K and Q8_0 blocks, 210 and 34, on 2, read in 2-byte
// halves); activation rows are whole 256-value blocks of codes.

#ifdef __CUDACC_RTC__
__device__ __forceinline__ int moec_dp4a(unsigned int a, unsigned int b, int c) {
    return __dp4a((int)a, (int)b, c);
}
#else
// The CPU emulation (kernels/cpu_emulation) has no __dp4a: the same signed byte products.
inline int moec_dp4a(unsigned int a, unsigned int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    }
    return c;
}
#endif

// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ unsigned int moec_load_u32_a2(const unsigned char* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (unsigned int)h[0] | ((unsigned int)h[1] << 16);
}

// Units per block and block bytes of each integer-product format.
template <int DT> struct MoeQ8 {};
template <> struct MoeQ8<3> { static const int UNITS = 4; static const int BYTES = 34; static const int ELEMS = 32; };
template <> struct MoeQ8<4> { static const int UNITS = 8; static const int BYTES = 144; static const int ELEMS = 256; };
template <> struct MoeQ8<5> { static const int UNITS = 8; static const int BYTES = 176; static const int ELEMS = 256; };
template <> struct MoeQ8<6> { static const int UNITS = 16; static const int BYTES = 210; static const int ELEMS = 256; };

// Unit `c` of block `b` of a stored row `wrow` times activation rows `src[r]` (row indices
// into `codes` [.., in_dim] and `scales` [.., in_dim / ELEMS]), added to acc[r], r < rows.
template <int DT>
__device__ __forceinline__ void moe_q8_unit(const unsigned char* __restrict__ wrow, int b, int c,
                                            const signed char* __restrict__ codes,
                                            const float* __restrict__ scales,
                                            const int* src, int rows, int in_dim, float* acc) {
    const unsigned char* blk = wrow + (long long)b * MoeQ8<DT>::BYTES;
    const long long nb = in_dim / MoeQ8<DT>::ELEMS;
    if (DT == 4 || DT == 5) {
        const int p = c >> 1;
        const int h = c & 1;
        const uint4 head = *(const uint4*)blk;
        const uint4 q = *(const uint4*)(blk + (DT == 4 ? 16 : 48) + 32 * p + 16 * h);
        uint4 qh = {0u, 0u, 0u, 0u};
        if (DT == 5) {
            qh = *(const uint4*)(blk + 16 + 16 * h);
        }
        const unsigned int s0 = head.y, s1 = head.z, s2 = head.w;
        const auto byte = [s0, s1, s2](int n) {
            return ((n < 4 ? s0 : (n < 8 ? s1 : s2)) >> (8 * (n & 3))) & 0xffu;
        };
        int sc0, m0, sc1, m1;
        moec_scale_min_k4(2 * p, byte, &sc0, &m0);
        moec_scale_min_k4(2 * p + 1, byte, &sc1, &m1);
        const float dx = moec_f16_to_f32((unsigned short)(head.x & 0xffffu));
        const float dmin = moec_f16_to_f32((unsigned short)(head.x >> 16));
        const unsigned int qw[4] = {q.x, q.y, q.z, q.w};
        const unsigned int hw[4] = {qh.x, qh.y, qh.z, qh.w};
        unsigned int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = qw[i] & 0x0f0f0f0fu;
            hi[i] = (qw[i] >> 4) & 0x0f0f0f0fu;
            if (DT == 5) {
                lo[i] |= ((hw[i] >> (2 * p)) & 0x01010101u) << 4;
                hi[i] |= ((hw[i] >> (2 * p + 1)) & 0x01010101u) << 4;
            }
        }
        const int at = 256 * b + 64 * p + 16 * h;
#pragma unroll
        for (int r = 0; r < MOE_TILE_M; ++r) {
            if (r < rows) {
                const signed char* a = codes + (long long)src[r] * in_dim + at;
                const uint4 alo = *(const uint4*)a;
                const uint4 ahi = *(const uint4*)(a + 32);
                const unsigned int al[4] = {alo.x, alo.y, alo.z, alo.w};
                const unsigned int ah[4] = {ahi.x, ahi.y, ahi.z, ahi.w};
                int dlo = 0, dhi = 0, slo = 0, shi = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    dlo = moec_dp4a(lo[i], al[i], dlo);
                    dhi = moec_dp4a(hi[i], ah[i], dhi);
                    slo = moec_dp4a(0x01010101u, al[i], slo);
                    shi = moec_dp4a(0x01010101u, ah[i], shi);
                }
                const int isum = sc0 * dlo + sc1 * dhi;
                const int imin = m0 * slo + m1 * shi;
                const float dy = scales[(long long)src[r] * nb + b];
                acc[r] += __fsub_rn(__fmul_rn(__fmul_rn(dx, dy), (float)isum),
                                    __fmul_rn(__fmul_rn(dmin, dy), (float)imin));
            }
        }
    } else if (DT == 6) {
        const int n = c >> 3;
        const int l4 = (c & 7) * 4;
        const unsigned int ql0 = moec_load_u32_a2(blk + 64 * n + l4);
        const unsigned int ql1 = moec_load_u32_a2(blk + 64 * n + 32 + l4);
        const unsigned int qh = moec_load_u32_a2(blk + 128 + 32 * n + l4);
        const signed char* sc = (const signed char*)(blk + 192 + 8 * n + l4 / 16);
        const int sc4[4] = {sc[0], sc[2], sc[4], sc[6]};
        const float dx = moec_f16_to_f32(*(const unsigned short*)(blk + 208));
        const unsigned int qs[4] = {
            (ql0 & 0x0f0f0f0fu) | ((qh & 0x03030303u) << 4),
            (ql1 & 0x0f0f0f0fu) | (((qh >> 2) & 0x03030303u) << 4),
            ((ql0 >> 4) & 0x0f0f0f0fu) | (((qh >> 4) & 0x03030303u) << 4),
            ((ql1 >> 4) & 0x0f0f0f0fu) | (((qh >> 6) & 0x03030303u) << 4),
        };
        const int at = 256 * b + 128 * n + l4;
#pragma unroll
        for (int r = 0; r < MOE_TILE_M; ++r) {
            if (r < rows) {
                const signed char* a = codes + (long long)src[r] * in_dim + at;
                int isum = 0;
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const unsigned int aw = *(const unsigned int*)(a + 32 * s);
                    // Codes 0..63 with the -32 through the code sum, as the CPU's bsums.
                    isum += sc4[s] * (moec_dp4a(qs[s], aw, 0) - 32 * moec_dp4a(0x01010101u, aw, 0));
                }
                const float dy = scales[(long long)src[r] * nb + b];
                acc[r] += __fmul_rn(__fmul_rn(dx, dy), (float)isum);
            }
        }
    } else {
        const unsigned int q0 = moec_load_u32_a2(blk + 2 + 8 * c);
        const unsigned int q1 = moec_load_u32_a2(blk + 6 + 8 * c);
        const float dx = moec_f16_to_f32(*(const unsigned short*)blk);
        const int at = 32 * b + 8 * c;
#pragma unroll
        for (int r = 0; r < MOE_TILE_M; ++r) {
            if (r < rows) {
                const unsigned int* a = (const unsigned int*)(codes + (long long)src[r] * in_dim + at);
                const int isum = moec_dp4a(q1, a[1], moec_dp4a(q0, a[0], 0));
                const float dy = scales[(long long)src[r] * nb + b];
                acc[r] += __fmul_rn(__fmul_rn(dx, dy), (float)isum);
            }
        }
    }
}

// The products of stored row `wrow` (format DT) with activation rows src[r], r < rows,
// by a group of G lanes (G a power of two <= 32; `j` the lane's index in its group):
// the lanes stride over the row's units, the loop unrolled 4 deep (loads of several units in flight),
// then the group's sums are reduced so every lane of the group holds acc[r] for each r.
// Every lane of the warp calls it with the same `rows` (it shuffles); `live` false: the
// lane's group has no output, its loads are skipped but it joins the shuffles.
template <int DT, int G>
__device__ __forceinline__ void moe_q8_rows(const unsigned char* __restrict__ wrow,
                                            const signed char* __restrict__ codes,
                                            const float* __restrict__ scales, const int* src,
                                            int rows, int in_dim, int j, bool live, float* acc) {
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        acc[r] = 0.0f;
    }
    const int units = (in_dim / MoeQ8<DT>::ELEMS) * MoeQ8<DT>::UNITS;
    if (live) {
#pragma unroll 4
        for (int u = j; u < units; u += G) {
            moe_q8_unit<DT>(wrow, u / MoeQ8<DT>::UNITS, u % MoeQ8<DT>::UNITS, codes, scales, src,
                            rows, in_dim, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        if (r < rows) {
            for (int off = G / 2; off > 0; off >>= 1) {
                acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
            }
        }
    }
}

// The sum of row r of acc (r < MOE_TILE_M), without dynamic register indexing.
__device__ __forceinline__ float moe_pick(const float* acc, int r) {
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_TILE_M; ++i) {
        if (i == r) {
            v = acc[i];
        }
    }
    return v;
}

// linear_gemv over 8-bit activations: y[r, o] (=|+=) Σ_blocks of x[r] . W[o] for r < n
// (<= MOE_TILE_M), `codes`/`scales` q8_quantize's rows of x, W [out, in] in format `dtype`
// (3 Q8_0, 4 Q4_K, 5 Q5_K, 6 Q6_K). `group` lanes per output (32, or 8 for a vocabulary
// head: four outputs a warp, a quarter of the shuffles per output).
// Launch: grid ceil(out / (256 / group)), block 256.
template <int DT, int G>
__device__ void linear_gemv_q8_t(const signed char* codes, const float* scales,
                                 const unsigned char* w, float* y, int n, int in_dim,
                                 int out_dim, int ldy, int accumulate) {
    const int j = threadIdx.x % G;
    const long long o = (long long)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool live = o < out_dim;
    const int rows = n < MOE_TILE_M ? n : MOE_TILE_M;
    int src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        src[r] = r < rows ? r : 0;
    }
    const long long row_bytes = (long long)(in_dim / MoeQ8<DT>::ELEMS) * MoeQ8<DT>::BYTES;
    float acc[MOE_TILE_M];
    moe_q8_rows<DT, G>(w + (live ? o : 0) * row_bytes, codes, scales, src, rows, in_dim, j,
                       live, acc);
    if (!live) {
        return;
    }
    for (int r = j; r < rows; r += G) {
        float* out = y + (long long)r * ldy + o;
        const float v = moe_pick(acc, r);
        *out = accumulate ? *out + v : v;
    }
}

extern "C" __global__ void linear_gemv_q8(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned char* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate,
    int group) {
#define MOE_Q8_LINEAR(DT)                                                                    \
    if (group == 8) {                                                                       \
        linear_gemv_q8_t<DT, 8>(codes, scales, w, y, n, in_dim, out_dim, ldy, accumulate);  \
    } else {                                                                                \
        linear_gemv_q8_t<DT, 32>(codes, scales, w, y, n, in_dim, out_dim, ldy, accumulate); \
    }
    switch (dtype) {
    case 3: MOE_Q8_LINEAR(3) break;
    case 4: MOE_Q8_LINEAR(4) break;
    case 5: MOE_Q8_LINEAR(5) break;
    default: MOE_Q8_LINEAR(6) break;
    }
#undef MOE_Q8_LINEAR
}

// moe_grouped_gemv over 8-bit activations: the same tiles, tables and epilogues (modes 0,
// 2 and 3; no biases), `codes`/`scales` q8_quantize's rows of x (gather 1: row perm_row[p]
// of the layer's normalised tokens; 0: row p of a grouped activation), a warp per (tile,
// output feature).
// Launch: grid (max tiles, ceil(out / MOE_GEMV_WARPS)), block 32 * MOE_GEMV_WARPS.
template <int DT>
__device__ void moe_grouped_gemv_q8_t(const signed char* codes, const float* scales,
                                      const unsigned int* perm_row, const unsigned int* perm_slot,
                                      const float* perm_weight, const int* tiles,
                                      const unsigned long long* weights,
                                      const unsigned long long* weights2, float* y, int gather,
                                      int mode, int in_dim, int out_dim, int top_k) {
    MoeWarpTile t;
    if (!moe_warp_tile(tiles, out_dim, t)) {
        return;
    }
    const int expert = t.expert, first = t.first, rows = t.rows, o = t.o, lane = t.lane;
    int src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        const int p = first + (r < rows ? r : 0);
        src[r] = gather ? (int)perm_row[p] : p;
    }
    const long long row_bytes = (long long)(in_dim / MoeQ8<DT>::ELEMS) * MoeQ8<DT>::BYTES;
    float acc[MOE_TILE_M];
    moe_q8_rows<DT, 32>((const unsigned char*)weights[expert] + o * row_bytes, codes, scales,
                        src, rows, in_dim, lane, true, acc);
    float up = 0.0f;
    if (mode == 3) {
        float acc_up[MOE_TILE_M];
        moe_q8_rows<DT, 32>((const unsigned char*)weights2[expert] + o * row_bytes, codes,
                            scales, src, rows, in_dim, lane, true, acc_up);
        up = moe_pick(acc_up, lane);
    }
    if (lane >= rows) {
        return;
    }
    moe_store(y, first + lane, o, out_dim, mode, moe_pick(acc, lane), up, perm_row, perm_slot,
              perm_weight, top_k);
}

extern "C" __global__ void moe_grouped_gemv_q8(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ weights2,
    float* __restrict__ y,
    int gather,
    int mode,
    int in_dim,
    int out_dim,
    int dtype,
    int top_k) {
#define MOE_Q8_GROUPED(DT)                                                                   \
    moe_grouped_gemv_q8_t<DT>(codes, scales, perm_row, perm_slot, perm_weight, tiles, weights, \
                              weights2, y, gather, mode, in_dim, out_dim, top_k);
    switch (dtype) {
    case 3: MOE_Q8_GROUPED(3) break;
    case 4: MOE_Q8_GROUPED(4) break;
    case 5: MOE_Q8_GROUPED(5) break;
    default: MOE_Q8_GROUPED(6) break;
    }
#undef MOE_Q8_GROUPED
}

// linear_gemv3 over 8-bit activations: up to three integer products of the same quantised
// rows (q, k and v sharing one q8_quantize) in one launch, outputs as linear_gemv3's, a
// warp per output, each matrix in its own format (3-6). Launch: as linear_gemv3.
template <int DT>
__device__ void linear_gemv3_q8_t(const signed char* codes, const float* scales,
                                  const unsigned char* w, float* y, int rows, int in_dim,
                                  long long o, int ldy, int col, int lane) {
    int src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        src[r] = r < rows ? r : 0;
    }
    const long long row_bytes = (long long)(in_dim / MoeQ8<DT>::ELEMS) * MoeQ8<DT>::BYTES;
    float acc[MOE_TILE_M];
    moe_q8_rows<DT, 32>(w + o * row_bytes, codes, scales, src, rows, in_dim, lane, true, acc);
    if (lane < rows) {
        y[(long long)lane * ldy + col + o] = moe_pick(acc, lane);
    }
}

extern "C" __global__ void linear_gemv3_q8(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned char* __restrict__ w0,
    const unsigned char* __restrict__ w1,
    const unsigned char* __restrict__ w2,
    int out0,
    int out1,
    int out2,
    int d0,
    int d1,
    int d2,
    float* __restrict__ y,
    int n,
    int in_dim,
    int ldy,
    int col1,
    int col2) {
    const int lane = threadIdx.x & 31;
    int o = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    const unsigned char* w = w0;
    int dtype = d0;
    int col = 0;
    if (o >= out0) {
        o -= out0;
        w = w1;
        dtype = d1;
        col = col1;
        if (o >= out1) {
            o -= out1;
            w = w2;
            dtype = d2;
            col = col2;
            if (o >= out2) {
                return;
            }
        }
    }
    const int rows = n < MOE_TILE_M ? n : MOE_TILE_M;
    switch (dtype) {
    case 3: linear_gemv3_q8_t<3>(codes, scales, w, y, rows, in_dim, o, ldy, col, lane); break;
    case 4: linear_gemv3_q8_t<4>(codes, scales, w, y, rows, in_dim, o, ldy, col, lane); break;
    case 5: linear_gemv3_q8_t<5>(codes, scales, w, y, rows, in_dim, o, ldy, col, lane); break;
    default: linear_gemv3_q8_t<6>(codes, scales, w, y, rows, in_dim, o, ldy, col, lane); break;
    }
}

#include "q8_block.cuh"

// ---- Integer products with the row count fixed at compile time (the default) ------------
// The kernels above keep MOE_TILE_M accumulators, row offsets and a 4-deep unrolled unit
// loop for any row count: ptxas gives them 186-255 registers, so an SM holds one block of
// 8 warps, and each warp waits for its loads one unit after another (an H200 ran the batch-1
// expert products at ~100-180 GB/s). These take the same units and the same arithmetic
// (value = (dx dy) f32(isum) - (dmin dy) f32(imin) per unit, as moe_q8_unit) with R rows
// fixed (R = 1: a decode step; R = 16: up to MOE_TILE_M rows, fewer skipped per warp):
//   - a warp per output row, each lane a whole unit (16 contiguous bytes of a Q4_K/Q5_K
//     block's codes, 12 of a Q6_K's, 8 of a Q8_0's) and its block's scales unpacked for it;
//   - the weight words of U units loaded into registers before any is used (U = 2 for one
//     weight row at R = 1: 56-72 registers on sm_90, no spills; U = 4 spilled), so a lane
//     keeps several loads in flight and an SM holds 24-32 warps;
//   - gate and up (mode 3) in one pass over the units: one activation load for both rows.
// Rows past R (never with the host's choice of R) run in further passes of R rows.
// The sums are the kernels above's up to f32 summation order (per unit, then per lane in
// unit order, then the warp's xor reduction).

// The weight words of one unit (format DT), loaded before use: Q4_K/Q5_K w0 = the 16-byte
// head (d, dmin, 12 scale bytes), w1 = the unit's 16 code bytes, w2 = Q5_K's high bits;
// Q6_K w0 = (ql0, ql1, qh, the unit's four scale bytes), w1.x = d; Q8_0 w0 = (q0, q1, d).
struct Q8vRaw {
    uint4 w0;
    uint4 w1;
    uint4 w2;
};

template <int DT>
__device__ __forceinline__ Q8vRaw q8v_load(const unsigned char* __restrict__ wrow, int b, int c) {
    const unsigned char* blk = wrow + (long long)b * MoeQ8<DT>::BYTES;
    Q8vRaw raw;
    const uint4 zero = {0u, 0u, 0u, 0u};
    raw.w0 = zero;
    raw.w1 = zero;
    raw.w2 = zero;
    if (DT == 4 || DT == 5) {
        const int p = c >> 1;
        const int h = c & 1;
        raw.w0 = *(const uint4*)blk;
        raw.w1 = *(const uint4*)(blk + (DT == 4 ? 16 : 48) + 32 * p + 16 * h);
        if (DT == 5) {
            raw.w2 = *(const uint4*)(blk + 16 + 16 * h);
        }
    } else if (DT == 6) {
        const int n = c >> 3;
        const int l4 = (c & 7) * 4;
        const unsigned char* sc = blk + 192 + 8 * n + l4 / 16;
        raw.w0.x = moec_load_u32_a2(blk + 64 * n + l4);
        raw.w0.y = moec_load_u32_a2(blk + 64 * n + 32 + l4);
        raw.w0.z = moec_load_u32_a2(blk + 128 + 32 * n + l4);
        raw.w0.w = (unsigned int)sc[0] | ((unsigned int)sc[2] << 8) | ((unsigned int)sc[4] << 16) |
                   ((unsigned int)sc[6] << 24);
        raw.w1.x = *(const unsigned short*)(blk + 208);
    } else {
        raw.w0.x = moec_load_u32_a2(blk + 2 + 8 * c);
        raw.w0.y = moec_load_u32_a2(blk + 6 + 8 * c);
        raw.w0.z = *(const unsigned short*)blk;
        raw.w0.w = 0u;
    }
    return raw;
}

// Unit c of block b: the NW weight rows' loaded words raw[w] times activation rows r < rows
// (codes at aoff[r], scales at soff[r]: element offsets of the rows), added to acc[w][r].
template <int DT, int R, int NW>
__device__ __forceinline__ void q8v_unit(const Q8vRaw* raw, int b, int c,
                                         const signed char* __restrict__ codes,
                                         const float* __restrict__ scales,
                                         const unsigned int* aoff, const unsigned int* soff,
                                         int rows, float (*acc)[R]) {
    if (DT == 4 || DT == 5) {
        const int p = c >> 1;
        const int h = c & 1;
        float dx[NW], dmin[NW];
        int sc0[NW], m0[NW], sc1[NW], m1[NW];
        unsigned int lo[NW][4], hi[NW][4];
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const uint4 head = raw[w].w0;
            const unsigned int s0 = head.y, s1 = head.z, s2 = head.w;
            const auto byte = [s0, s1, s2](int n) {
                return ((n < 4 ? s0 : (n < 8 ? s1 : s2)) >> (8 * (n & 3))) & 0xffu;
            };
            moec_scale_min_k4(2 * p, byte, &sc0[w], &m0[w]);
            moec_scale_min_k4(2 * p + 1, byte, &sc1[w], &m1[w]);
            dx[w] = moec_f16_to_f32((unsigned short)(head.x & 0xffffu));
            dmin[w] = moec_f16_to_f32((unsigned short)(head.x >> 16));
            const unsigned int qw[4] = {raw[w].w1.x, raw[w].w1.y, raw[w].w1.z, raw[w].w1.w};
            const unsigned int hw[4] = {raw[w].w2.x, raw[w].w2.y, raw[w].w2.z, raw[w].w2.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[w][i] = qw[i] & 0x0f0f0f0fu;
                hi[w][i] = (qw[i] >> 4) & 0x0f0f0f0fu;
                if (DT == 5) {
                    lo[w][i] |= ((hw[i] >> (2 * p)) & 0x01010101u) << 4;
                    hi[w][i] |= ((hw[i] >> (2 * p + 1)) & 0x01010101u) << 4;
                }
            }
        }
        const int at = 256 * b + 64 * p + 16 * h;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (R == 1 || r < rows) {
                const signed char* a = codes + aoff[r] + at;
                const uint4 alo = *(const uint4*)a;
                const uint4 ahi = *(const uint4*)(a + 32);
                const unsigned int al[4] = {alo.x, alo.y, alo.z, alo.w};
                const unsigned int ah[4] = {ahi.x, ahi.y, ahi.z, ahi.w};
                int slo = 0, shi = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    slo = moec_dp4a(0x01010101u, al[i], slo);
                    shi = moec_dp4a(0x01010101u, ah[i], shi);
                }
                const float dy = scales[soff[r] + b];
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    int dlo = 0, dhi = 0;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        dlo = moec_dp4a(lo[w][i], al[i], dlo);
                        dhi = moec_dp4a(hi[w][i], ah[i], dhi);
                    }
                    const int isum = sc0[w] * dlo + sc1[w] * dhi;
                    const int imin = m0[w] * slo + m1[w] * shi;
                    acc[w][r] += __fsub_rn(__fmul_rn(__fmul_rn(dx[w], dy), (float)isum),
                                           __fmul_rn(__fmul_rn(dmin[w], dy), (float)imin));
                }
            }
        }
    } else if (DT == 6) {
        const int n = c >> 3;
        const int l4 = (c & 7) * 4;
        unsigned int qs[NW][4];
        int sc4[NW][4];
        float dx[NW];
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const unsigned int ql0 = raw[w].w0.x, ql1 = raw[w].w0.y, qh = raw[w].w0.z;
            qs[w][0] = (ql0 & 0x0f0f0f0fu) | ((qh & 0x03030303u) << 4);
            qs[w][1] = (ql1 & 0x0f0f0f0fu) | (((qh >> 2) & 0x03030303u) << 4);
            qs[w][2] = ((ql0 >> 4) & 0x0f0f0f0fu) | (((qh >> 4) & 0x03030303u) << 4);
            qs[w][3] = ((ql1 >> 4) & 0x0f0f0f0fu) | (((qh >> 6) & 0x03030303u) << 4);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                sc4[w][s] = (int)(signed char)(raw[w].w0.w >> (8 * s));
            }
            dx[w] = moec_f16_to_f32((unsigned short)raw[w].w1.x);
        }
        const int at = 256 * b + 128 * n + l4;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (R == 1 || r < rows) {
                const signed char* a = codes + aoff[r] + at;
                unsigned int aw[4];
                int asum[4];
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    aw[s] = *(const unsigned int*)(a + 32 * s);
                    asum[s] = moec_dp4a(0x01010101u, aw[s], 0);
                }
                const float dy = scales[soff[r] + b];
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    int isum = 0;
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
                        // Codes 0..63 with the -32 through the code sum, as the CPU's bsums.
                        isum += sc4[w][s] * (moec_dp4a(qs[w][s], aw[s], 0) - 32 * asum[s]);
                    }
                    acc[w][r] += __fmul_rn(__fmul_rn(dx[w], dy), (float)isum);
                }
            }
        }
    } else {
        const int at = 32 * b + 8 * c;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (R == 1 || r < rows) {
                const unsigned int* a = (const unsigned int*)(codes + aoff[r] + at);
                const unsigned int a0 = a[0], a1 = a[1];
                const float dy = scales[soff[r] + b];
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    const int isum = moec_dp4a(raw[w].w0.y, a1, moec_dp4a(raw[w].w0.x, a0, 0));
                    const float dx = moec_f16_to_f32((unsigned short)raw[w].w0.z);
                    acc[w][r] += __fmul_rn(__fmul_rn(dx, dy), (float)isum);
                }
            }
        }
    }
}

// The products of NW stored rows wrow[w] (format DT, same shape) with activation rows
// r < rows (<= R) by a group of G lanes (a power of two <= 32): lane j of the group takes
// units j, j + G, ..., U at a time (every unit's weight words loaded before the first is
// used), then the group's xor reduction, so every lane of it holds acc[w][r]. Every lane
// of the warp calls it with the same in_dim and rows (it shuffles); `live` false: no
// loads, zero sums.
template <int DT, int R, int NW, int U, int G>
__device__ __forceinline__ void q8v_rows(const unsigned char* const* wrow,
                                         const signed char* __restrict__ codes,
                                         const float* __restrict__ scales,
                                         const unsigned int* aoff, const unsigned int* soff,
                                         int rows, int in_dim, int j, bool live,
                                         float (*acc)[R]) {
#pragma unroll
    for (int w = 0; w < NW; ++w) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[w][r] = 0.0f;
        }
    }
    const int units = live ? (in_dim / MoeQ8<DT>::ELEMS) * MoeQ8<DT>::UNITS : 0;
    for (int u0 = j; u0 < units; u0 += G * U) {
        Q8vRaw raw[U][NW];
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = u0 + G * k;
            if (u < units) {
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    raw[k][w] = q8v_load<DT>(wrow[w], u / MoeQ8<DT>::UNITS, u % MoeQ8<DT>::UNITS);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
            const int u = u0 + G * k;
            if (u < units) {
                q8v_unit<DT, R, NW>(raw[k], u / MoeQ8<DT>::UNITS, u % MoeQ8<DT>::UNITS, codes,
                                    scales, aoff, soff, rows, acc);
            }
        }
    }
#pragma unroll
    for (int w = 0; w < NW; ++w) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (R == 1 || r < rows) {
#pragma unroll
                for (int off = G / 2; off > 0; off >>= 1) {
                    acc[w][r] += __shfl_xor_sync(0xffffffffu, acc[w][r], off);
                }
            }
        }
    }
}

// acc[r] for a lane's row r < R, without dynamic register indexing.
template <int R>
__device__ __forceinline__ float q8v_pick(const float* acc, int r) {
    float v = acc[0];
#pragma unroll
    for (int i = 1; i < R; ++i) {
        if (i == r) {
            v = acc[i];
        }
    }
    return v;
}

// The *_x1 kernels' own quantisation of their activation rows: rows of x `x_row` floats
// apart, `kind` 0 Q8_K / 1 Q8_0 (as q8_quantize's), each quantised by the block into its
// dynamic shared memory (the codes, then the scales from the next 16-byte boundary;
// round_up(in_dim, 16) + 4 in_dim / block bytes) before the block's warps use it: no
// q8_quantize launch (and graph node) before a one-row product, and the same codes.
struct Q8vFold {
    const float* x;
    long long x_row;
    int kind;
};

// Row `xr` (in_dim floats) quantised by the block's warps with moec_q8_block (the CPU's
// codes and scales) into shared `codes` / `scales`. Every thread of the block calls it
// (barriers before, so a previous row's readers are done, and after).
__device__ __forceinline__ void q8v_quantize_row(const float* __restrict__ xr, int in_dim,
                                                 int kind, signed char* codes, float* scales) {
    const int block = kind == 0 ? 256 : 32;
    const int per_lane = block / 32;
    const int lane = threadIdx.x & 31;
    __syncthreads();
    for (int b = threadIdx.x >> 5; b < in_dim / block; b += blockDim.x >> 5) {
        int q[8];
        const float scale = moec_q8_block(xr + (long long)b * block, kind, lane, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (i < per_lane) {
                codes[b * block + lane * per_lane + i] = (signed char)q[i];
            }
        }
        if (lane == 0) {
            scales[b] = scale;
        }
    }
    __syncthreads();
}

// The R-row products of one output row (format DT; NW weight rows wrow[w]) over
// activation rows row(r), r < rows, by a group of G lanes (j: the lane's index in it), in
// passes of R rows; `emit(r, v, up)` takes the sums of row r (up: the second weight
// row's, NW = 2), called by lane r mod G of a live group only. `live` as q8v_rows.
// FOLD (R = 1): row(base) of fold.x quantised into shared memory each pass (`codes` and
// `scales` unused); every thread of the block calls it with the same rows (barriers).
template <int DT, int R, int NW, int G, bool FOLD, typename Row, typename Emit>
__device__ __forceinline__ void q8v_output(const unsigned char* const* wrow,
                                           const signed char* __restrict__ codes,
                                           const float* __restrict__ scales, Q8vFold fold,
                                           int rows, int in_dim, int j, bool live, Row row,
                                           Emit emit) {
    const int nb = in_dim / MoeQ8<DT>::ELEMS;
    for (int base = 0; base < rows; base += R) {
        const int n = rows - base < R ? rows - base : R;
        unsigned int aoff[R], soff[R];
        const signed char* c = codes;
        const float* sc = scales;
        if (FOLD) {
            extern __shared__ uint4 q8v_smem[];
            signed char* sm_codes = (signed char*)q8v_smem;
            float* sm_scales = (float*)(sm_codes + ((in_dim + 15) & ~15));
            q8v_quantize_row(fold.x + (long long)row(base) * fold.x_row, in_dim, fold.kind,
                             sm_codes, sm_scales);
            c = sm_codes;
            sc = sm_scales;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                aoff[r] = 0u;
                soff[r] = 0u;
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned int s = row(base + (r < n ? r : 0));
                aoff[r] = s * (unsigned int)in_dim;
                soff[r] = s * (unsigned int)nb;
            }
        }
        float acc[NW][R];
        q8v_rows<DT, R, NW, (R == 1 ? (NW == 1 ? 2 : 1) : 1), G>(wrow, c, sc, aoff, soff, n,
                                                                 in_dim, j, live, acc);
        if (live) {
            for (int r = j; r < n; r += G) {
                emit(base + r, q8v_pick<R>(acc[0], r), q8v_pick<R>(acc[NW - 1], r));
            }
        }
    }
}

// linear_gemv_q8 with R rows fixed: y[r, o] (=|+=) Σ_blocks x[r] . W[o] for r < n, G
// lanes per output (32; 8 for a vocabulary head: a quarter of the threads, which the
// stand-in runs one by one). Launch: grid ceil(out / (256 / G)), block 256.
template <int R, int G, bool FOLD>
__device__ void q8v_linear_t(const signed char* codes, const float* scales, Q8vFold fold,
                             const unsigned char* w, float* y, int n, int in_dim, int out_dim,
                             int dtype, int ldy, int accumulate) {
    const int j = threadIdx.x % G;
    const long long at = (long long)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool live = at < out_dim;
    const long long o = live ? at : 0;
    const auto row = [](int r) { return (unsigned int)r; };
    const auto emit = [y, o, ldy, accumulate](int r, float v, float) {
        float* out = y + (long long)r * ldy + o;
        *out = accumulate ? *out + v : v;
    };
#define Q8V_LINEAR(DT)                                                                     \
    {                                                                                      \
        const unsigned char* wr[1] = {w + o * (long long)(in_dim / MoeQ8<DT>::ELEMS) *     \
                                              MoeQ8<DT>::BYTES};                           \
        q8v_output<DT, R, 1, G, FOLD>(wr, codes, scales, fold, n, in_dim, j, live, row, emit); \
    }
    switch (dtype) {
    case 3: Q8V_LINEAR(3) break;
    case 4: Q8V_LINEAR(4) break;
    case 5: Q8V_LINEAR(5) break;
    default: Q8V_LINEAR(6) break;
    }
#undef Q8V_LINEAR
}

// linear_gemv3_q8 with R rows fixed (same arguments and launch as linear_gemv3_q8).
template <int R, bool FOLD>
__device__ void q8v_linear3_t(const signed char* codes, const float* scales, Q8vFold fold,
                              const unsigned char* w0, const unsigned char* w1,
                              const unsigned char* w2, int out0, int out1, int out2, int d0,
                              int d1, int d2, float* y, int n, int in_dim, int ldy, int col1,
                              int col2) {
    const int lane = threadIdx.x & 31;
    int o = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    const unsigned char* w = w0;
    int dtype = d0;
    int col = 0;
    int seg_out = out0;
    if (o >= out0) {
        o -= out0;
        w = w1;
        dtype = d1;
        col = col1;
        seg_out = out1;
        if (o >= out1) {
            o -= out1;
            w = w2;
            dtype = d2;
            col = col2;
            seg_out = out2;
        }
    }
    // Past the last output: no products (FOLD: the warp still joins the barriers).
    const bool live = o < seg_out;
    if (!live && !FOLD) {
        return;
    }
    if (!live) {
        o = 0;
    }
    const auto row = [](int r) { return (unsigned int)r; };
    const auto emit = [y, o, ldy, col](int r, float v, float) {
        y[(long long)r * ldy + col + o] = v;
    };
#define Q8V_LINEAR3(DT)                                                                    \
    {                                                                                      \
        const unsigned char* wr[1] = {w + (long long)o * (in_dim / MoeQ8<DT>::ELEMS) *     \
                                              MoeQ8<DT>::BYTES};                           \
        q8v_output<DT, R, 1, 32, FOLD>(wr, codes, scales, fold, n, in_dim, lane, live, row,  \
                                       emit);                                              \
    }
    switch (dtype) {
    case 3: Q8V_LINEAR3(3) break;
    case 4: Q8V_LINEAR3(4) break;
    case 5: Q8V_LINEAR3(5) break;
    default: Q8V_LINEAR3(6) break;
    }
#undef Q8V_LINEAR3
}

// moe_grouped_gemv_q8 with R rows fixed (same arguments, modes and launch): mode 3 takes
// gate and up in one pass over the units.
template <int R, bool FOLD>
__device__ void q8v_grouped_t(const signed char* codes, const float* scales, Q8vFold fold,
                              const unsigned int* perm_row, const unsigned int* perm_slot,
                              const float* perm_weight, const int* tiles,
                              const unsigned long long* weights,
                              const unsigned long long* weights2, float* y, int gather, int mode,
                              int in_dim, int out_dim, int dtype, int top_k) {
    MoeWarpTile t;
    // FOLD: a warp past out_dim still joins its block's barriers (its tile is the block's).
    const int o_at = blockIdx.y * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    const bool live = o_at < out_dim;
    if (FOLD && !live && blockIdx.x < tiles[0]) {
        moe_warp_tile(tiles, o_at + 1, t);
        t.o = 0;
    } else if (!moe_warp_tile(tiles, out_dim, t)) {
        return;
    }
    const int first = t.first;
    const auto row = [perm_row, gather, first](int r) {
        return gather ? perm_row[first + r] : (unsigned int)(first + r);
    };
    const auto emit = [y, first, o = t.o, out_dim, mode, perm_row, perm_slot, perm_weight,
                       top_k](int r, float v, float up) {
        moe_store(y, first + r, o, out_dim, mode, v, up, perm_row, perm_slot, perm_weight, top_k);
    };
#define Q8V_GROUPED(DT)                                                                    \
    {                                                                                      \
        const long long at = (long long)t.o * (in_dim / MoeQ8<DT>::ELEMS) * MoeQ8<DT>::BYTES; \
        if (mode == 3) {                                                                   \
            const unsigned char* wr[2] = {(const unsigned char*)weights[t.expert] + at,    \
                                          (const unsigned char*)weights2[t.expert] + at};  \
            q8v_output<DT, R, 2, 32, FOLD>(wr, codes, scales, fold, t.rows, in_dim, t.lane, live, \
                                           row, emit);                                     \
        } else {                                                                           \
            const unsigned char* wr[1] = {(const unsigned char*)weights[t.expert] + at};   \
            q8v_output<DT, R, 1, 32, FOLD>(wr, codes, scales, fold, t.rows, in_dim, t.lane, live, \
                                           row, emit);                                     \
        }                                                                                  \
    }
    switch (dtype) {
    case 3: Q8V_GROUPED(3) break;
    case 4: Q8V_GROUPED(4) break;
    case 5: Q8V_GROUPED(5) break;
    default: Q8V_GROUPED(6) break;
    }
#undef Q8V_GROUPED
}

// The entries: _r1 for one activation row (a batch-1 decode step), _r16 for up to
// MOE_TILE_M rows a pass (the host picks by its row count). Written out, not through a
// macro: the host lists the entries by reading their definitions.
extern "C" __global__ void linear_gemv_q8_r1(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned char* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate,
    int group) {
    if (group == 8) {
        q8v_linear_t<1, 8, false>(codes, scales, Q8vFold{}, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
    } else {
        q8v_linear_t<1, 32, false>(codes, scales, Q8vFold{}, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
    }
}

extern "C" __global__ void linear_gemv3_q8_r1(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned char* __restrict__ w0,
    const unsigned char* __restrict__ w1,
    const unsigned char* __restrict__ w2,
    int out0,
    int out1,
    int out2,
    int d0,
    int d1,
    int d2,
    float* __restrict__ y,
    int n,
    int in_dim,
    int ldy,
    int col1,
    int col2) {
    q8v_linear3_t<1, false>(codes, scales, Q8vFold{}, w0, w1, w2, out0, out1, out2, d0, d1, d2, y, n, in_dim, ldy,
                      col1, col2);
}

extern "C" __global__ void moe_grouped_gemv_q8_r1(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ weights2,
    float* __restrict__ y,
    int gather,
    int mode,
    int in_dim,
    int out_dim,
    int dtype,
    int top_k) {
    q8v_grouped_t<1, false>(codes, scales, Q8vFold{}, perm_row, perm_slot, perm_weight, tiles, weights, weights2, y,
                      gather, mode, in_dim, out_dim, dtype, top_k);
}

extern "C" __global__ void linear_gemv_q8_r16(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned char* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate,
    int group) {
    if (group == 8) {
        q8v_linear_t<16, 8, false>(codes, scales, Q8vFold{}, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
    } else {
        q8v_linear_t<16, 32, false>(codes, scales, Q8vFold{}, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
    }
}

extern "C" __global__ void linear_gemv3_q8_r16(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned char* __restrict__ w0,
    const unsigned char* __restrict__ w1,
    const unsigned char* __restrict__ w2,
    int out0,
    int out1,
    int out2,
    int d0,
    int d1,
    int d2,
    float* __restrict__ y,
    int n,
    int in_dim,
    int ldy,
    int col1,
    int col2) {
    q8v_linear3_t<16, false>(codes, scales, Q8vFold{}, w0, w1, w2, out0, out1, out2, d0, d1, d2, y, n, in_dim, ldy,
                      col1, col2);
}

extern "C" __global__ void moe_grouped_gemv_q8_r16(
    const signed char* __restrict__ codes,
    const float* __restrict__ scales,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ weights2,
    float* __restrict__ y,
    int gather,
    int mode,
    int in_dim,
    int out_dim,
    int dtype,
    int top_k) {
    q8v_grouped_t<16, false>(codes, scales, Q8vFold{}, perm_row, perm_slot, perm_weight, tiles, weights, weights2, y,
                      gather, mode, in_dim, out_dim, dtype, top_k);
}

// The one-row entries that quantise their row themselves (Q8vFold): the _r1 kernels'
// arguments with (x, x_row, kind) for (codes, scales). Launch: as the _r1 kernels, with
// round_up(in_dim, 16) + 4 * in_dim / (kind 0 ? 256 : 32) bytes of dynamic shared memory.
extern "C" __global__ void linear_gemv_q8_x1(
    const float* __restrict__ x,
    long long x_row,
    int kind,
    const unsigned char* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate,
    int group) {
    const Q8vFold fold = {x, x_row, kind};
    if (group == 8) {
        q8v_linear_t<1, 8, true>(0, 0, fold, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
    } else {
        q8v_linear_t<1, 32, true>(0, 0, fold, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
    }
}

extern "C" __global__ void linear_gemv3_q8_x1(
    const float* __restrict__ x,
    long long x_row,
    int kind,
    const unsigned char* __restrict__ w0,
    const unsigned char* __restrict__ w1,
    const unsigned char* __restrict__ w2,
    int out0,
    int out1,
    int out2,
    int d0,
    int d1,
    int d2,
    float* __restrict__ y,
    int n,
    int in_dim,
    int ldy,
    int col1,
    int col2) {
    const Q8vFold fold = {x, x_row, kind};
    q8v_linear3_t<1, true>(0, 0, fold, w0, w1, w2, out0, out1, out2, d0, d1, d2, y, n, in_dim,
                           ldy, col1, col2);
}

extern "C" __global__ void moe_grouped_gemv_q8_x1(
    const float* __restrict__ x,
    long long x_row,
    int kind,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ weights2,
    float* __restrict__ y,
    int gather,
    int mode,
    int in_dim,
    int out_dim,
    int dtype,
    int top_k) {
    const Q8vFold fold = {x, x_row, kind};
    q8v_grouped_t<1, true>(0, 0, fold, perm_row, perm_slot, perm_weight, tiles, weights,
                           weights2, y, gather, mode, in_dim, out_dim, dtype, top_k);
}

// ---- One activation row, 16-bit weights ------------------------------------------------
// A batch-1 decode step's products (every expert tile then has one row) with bf16/f16
// weights: the generic loops keep MOE_TILE_M accumulators and row offsets in registers for
// any tile, which bounds the warps an SM holds; these keep one, and issue a lane's four
// 16-byte weight loads (as raw words) before using any. The sums are the generic loop's
// bit for bit (each lane's 8-term sums in the same order, the same warp reduction).
// The host launches them only for one row, bf16/f16 weights and 16-byte aligned weights
// and x with in_dim % 8 == 0 (no fallback inside, so no generic path's registers).
// A lane's four 16-byte weight loads of one chunk of 1024 inputs (k0 = lane * 8 + 1024 c;
// inputs k0 + 256 u), as raw words; zeros past in_dim.
__device__ __forceinline__ void moe_half_load4(const unsigned short* __restrict__ w, int k0,
                                               int in_dim, uint4* raw) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int k = k0 + 256 * u;
        if (k < in_dim) {
            raw[u] = *(const uint4*)(w + k);
        } else {
            raw[u].x = raw[u].y = raw[u].z = raw[u].w = 0u;
        }
    }
}

// A float norm weight (format `code` 0-2, which the host checks) at k as f32: rms_norm's
// moec_load without its block formats (inlined 32 times, they made the kernel's
// compilation a minute long).
__device__ __forceinline__ float moe_norm_at(const void* nw, int k, int code) {
    if (code == 0) {
        return moec_bf16_to_f32(((const unsigned short*)nw)[k]);
    }
    if (code == 1) {
        return moec_f16_to_f32(((const unsigned short*)nw)[k]);
    }
    return ((const float*)nw)[k];
}

// The norm weights of a lane's chunk (moe_half_load4's inputs) into nv[8 u + j].
__device__ __forceinline__ void moe_norm_load32(const void* nw, int code, int k0, int in_dim,
                                                float* nv) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int k = k0 + 256 * u;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            nv[8 * u + j] = k < in_dim ? moe_norm_at(nw, k + j, code) : 0.0f;
        }
    }
}

// acc plus a lane's chunk (raw: moe_half_load4's words) times x, in the generic loop's
// order and expression (8-term sums, k ascending), so the sums are its bits. NORM: each
// activation normalised first as rms_norm writes it, nv * (x * s) (moe_warp_rows_dot_t's).
template <int DT, bool NORM>
__device__ __forceinline__ float moe_half_dot4(const uint4* raw, const float* nv, int k0,
                                               int in_dim, const float* __restrict__ x,
                                               float s, float acc) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int k = k0 + 256 * u;
        if (k < in_dim) {
            const unsigned int words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
            float wv[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned short lo = (unsigned short)(words[j] & 0xffffu);
                const unsigned short hi = (unsigned short)(words[j] >> 16);
                wv[2 * j] = DT == 0 ? moec_bf16_to_f32(lo) : moec_f16_to_f32(lo);
                wv[2 * j + 1] = DT == 0 ? moec_bf16_to_f32(hi) : moec_f16_to_f32(hi);
            }
            float4 a = *(const float4*)(x + k);
            float4 b = *(const float4*)(x + k + 4);
            if (NORM) {
                const float* n = nv + 8 * u;
                a.x = n[0] * (a.x * s);
                a.y = n[1] * (a.y * s);
                a.z = n[2] * (a.z * s);
                a.w = n[3] * (a.w * s);
                b.x = n[4] * (b.x * s);
                b.y = n[5] * (b.y * s);
                b.z = n[6] * (b.z * s);
                b.w = n[7] * (b.w * s);
            }
            acc += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                 + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
        }
    }
    return acc;
}

__device__ __forceinline__ float moe_warp_sum(float acc) {
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
    }
    return acc;
}

// One row's product by a warp: two chunks (eight 16-byte loads a lane) in flight before
// any is used (one chunk at a time left a 3584-wide down projection four round trips
// deep).
template <int DT>
__device__ __forceinline__ float moe_dot1_half(const unsigned short* __restrict__ w,
                                               const float* __restrict__ x, int in_dim,
                                               int lane) {
    float acc = 0.0f;
    for (int k0 = lane * 8; k0 < in_dim; k0 += 2048) {
        uint4 raw[8];
        moe_half_load4(w, k0, in_dim, raw);
        moe_half_load4(w, k0 + 1024, in_dim, raw + 4);
        acc = moe_half_dot4<DT, false>(raw, 0, k0, in_dim, x, 0.0f, acc);
        acc = moe_half_dot4<DT, false>(raw + 4, 0, k0 + 1024, in_dim, x, 0.0f, acc);
    }
    return moe_warp_sum(acc);
}

// Two rows' products with the same x (an expert's gate and up rows), both rows' loads of
// a chunk in flight together; each sum is moe_dot1_half's.
template <int DT>
__device__ __forceinline__ void moe_dot2_half(const unsigned short* __restrict__ w0,
                                              const unsigned short* __restrict__ w1,
                                              const float* __restrict__ x, int in_dim,
                                              int lane, float* v0, float* v1) {
    float a0 = 0.0f, a1 = 0.0f;
    for (int k0 = lane * 8; k0 < in_dim; k0 += 1024) {
        uint4 r0[4], r1[4];
        moe_half_load4(w0, k0, in_dim, r0);
        moe_half_load4(w1, k0, in_dim, r1);
        a0 = moe_half_dot4<DT, false>(r0, 0, k0, in_dim, x, 0.0f, a0);
        a1 = moe_half_dot4<DT, false>(r1, 0, k0, in_dim, x, 0.0f, a1);
    }
    *v0 = moe_warp_sum(a0);
    *v1 = moe_warp_sum(a1);
}

__device__ __forceinline__ float moe_dot1(const void* w, long long row, int dtype,
                                          const float* x, int in_dim, int lane) {
    const unsigned short* r = (const unsigned short*)w + row;
    return dtype == 0 ? moe_dot1_half<0>(r, x, in_dim, lane) : moe_dot1_half<1>(r, x, in_dim, lane);
}

// moe_grouped_gemv for tiles of one row (a decode step of one token: top-k experts are
// distinct, so each has at most one entry), bf16/f16 weights, no biases; same arguments
// (biases and bias_dtype ignored: the host passes none), modes 0-3.
extern "C" __global__ void moe_grouped_gemv_1(
    const float* __restrict__ x,
    const unsigned int* __restrict__ perm_row,
    const unsigned int* __restrict__ perm_slot,
    const float* __restrict__ perm_weight,
    const int* __restrict__ tiles,
    const unsigned long long* __restrict__ weights,
    const unsigned long long* __restrict__ weights2,
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
    MoeWarpTile t;
    if (!moe_warp_tile(tiles, out_dim, t)) {
        return;
    }
    const int expert = t.expert, o = t.o, lane = t.lane;
    const long long p = t.first;
    const float* xr = x + (gather ? (long long)perm_row[p] : p) * in_dim;
    float v;
    float up = 0.0f;
    if (mode == 3) {
        // Gate and up rows loaded together (one round trip, not two).
        const unsigned short* g = (const unsigned short*)weights[expert] + (long long)o * in_dim;
        const unsigned short* u = (const unsigned short*)weights2[expert] + (long long)o * in_dim;
        if (dtype == 0) {
            moe_dot2_half<0>(g, u, xr, in_dim, lane, &v, &up);
        } else {
            moe_dot2_half<1>(g, u, xr, in_dim, lane, &v, &up);
        }
    } else {
        v = moe_dot1((const void*)weights[expert], (long long)o * in_dim, dtype, xr, in_dim, lane);
    }
    if (lane == 0) {
        moe_store(y, p, o, out_dim, mode, v, up, perm_row, perm_slot, perm_weight, top_k);
    }
}

// linear_gemv for one row with bf16/f16 weights (the same arguments; n must be 1).
extern "C" __global__ void linear_gemv_1(
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
    const float v = moe_dot1(w, (long long)o * in_dim, dtype, x, in_dim, lane);
    if (lane == 0) {
        y[o] = accumulate ? y[o] + v : v;
    }
}

// linear_gemv3 for one row with bf16/f16 weights (codes 0/1 for all three; the same
// arguments; n must be 1; weights and x as one_row_half requires; a float norm weight,
// code 0-2): a
// batch-1 step's q|k|v. Each warp loads its first chunk of weights (and of norm weights)
// before it takes the row's RMSNorm scale itself (moe_warp_norm: rms_norm's bits, no
// barrier, the row's 4 KB from L1 after the first warp), so the weight round trip and
// the norm overlap; linear_gemv3's block took the norm with block barriers before any
// warp loaded a weight. The same products as linear_gemv3 at one row, bit for bit.
extern "C" __global__ void linear_gemv3_1(
    const float* __restrict__ x,
    const void* __restrict__ w0,
    const void* __restrict__ w1,
    const void* __restrict__ w2,
    int out0,
    int out1,
    int out2,
    int d0,
    int d1,
    int d2,
    float* __restrict__ y,
    int n,
    int in_dim,
    int ldy,
    int col1,
    int col2,
    const void* __restrict__ norm_w,
    int norm_code,
    float eps,
    int norm_threads) {
    const int lane = threadIdx.x & 31;
    int o = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    const void* w = w0;
    int dtype = d0;
    int col = 0;
    if (o >= out0) {
        o -= out0;
        w = w1;
        dtype = d1;
        col = col1;
        if (o >= out1) {
            o -= out1;
            w = w2;
            dtype = d2;
            col = col2;
            if (o >= out2) {
                return;
            }
        }
    }
    const unsigned short* row = (const unsigned short*)w + (long long)o * in_dim;
    const int k0 = lane * 8;
    uint4 raw[4];
    moe_half_load4(row, k0, in_dim, raw);
    float acc = 0.0f;
    if (norm_w != 0) {
        float nv[32];
        moe_norm_load32(norm_w, norm_code, k0, in_dim, nv);
        const float s = moe_warp_norm(x, in_dim, eps, 0, norm_threads, lane, 0);
        acc = dtype == 0 ? moe_half_dot4<0, true>(raw, nv, k0, in_dim, x, s, acc)
                         : moe_half_dot4<1, true>(raw, nv, k0, in_dim, x, s, acc);
        for (int k = k0 + 1024; k < in_dim; k += 1024) {
            moe_half_load4(row, k, in_dim, raw);
            moe_norm_load32(norm_w, norm_code, k, in_dim, nv);
            acc = dtype == 0 ? moe_half_dot4<0, true>(raw, nv, k, in_dim, x, s, acc)
                             : moe_half_dot4<1, true>(raw, nv, k, in_dim, x, s, acc);
        }
    } else {
        acc = dtype == 0 ? moe_half_dot4<0, false>(raw, 0, k0, in_dim, x, 0.0f, acc)
                         : moe_half_dot4<1, false>(raw, 0, k0, in_dim, x, 0.0f, acc);
        for (int k = k0 + 1024; k < in_dim; k += 1024) {
            moe_half_load4(row, k, in_dim, raw);
            acc = dtype == 0 ? moe_half_dot4<0, false>(raw, 0, k, in_dim, x, 0.0f, acc)
                             : moe_half_dot4<1, false>(raw, 0, k, in_dim, x, 0.0f, acc);
        }
    }
    acc = moe_warp_sum(acc);
    if (lane == 0) {
        y[col + o] = acc;
    }
}

// ---- The MoE gate in one launch --------------------------------------------------------
// moe_gate_route_block (MOEC_FLOAT_KERNELS=block; moe_gate_route below is the default):
// a decode step's gate for `gridDim.x` rows (at most MOE_TILE_M): each block normalises its
// residual row into x_norm (rms_norm.cu's rms_norm, or layer_norm when `layer_norm`, with
// weight `norm_w` of format `norm_code`; launched at rms_norm's block size, row_block(d),
// the same bits), takes the router's logits of that row (linear_gemv's products with the
// float router `router` [n_experts, d] of format `router_code`, a warp per expert, bit for
// bit), chooses router_topk's experts into the packed route, and zeroes the row's top_k
// slots of `slots` ([rows, top_k, d]; null: none). Four launches and a memset of the
// unfused gate in one; the same values. n_experts <= ROUTER_MAX_EXPERTS, top_k <= n_experts
// (the host checks both).
// Launch: grid (rows), block row_block(d) (a multiple of 32, at most 256).
extern "C" __global__ void moe_gate_route_block(
    const float* __restrict__ x,
    const void* __restrict__ norm_w,
    int norm_code,
    int layer_norm,
    float eps,
    const void* __restrict__ router,
    int router_code,
    float* __restrict__ x_norm,
    float* __restrict__ slots,
    unsigned int* __restrict__ route,
    int d,
    int n_experts,
    int top_k,
    float norm_p) {
    __shared__ float logits[ROUTER_MAX_EXPERTS];
    const long long row = blockIdx.x;
    float* normed = x_norm + row * d;
    moec_norm_row(x + row * d, norm_w, norm_code, normed, d, eps, layer_norm, blockDim.x);
    // The block's writes of the row are visible to all its threads after the barrier.
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    long long src[MOE_TILE_M];
#pragma unroll
    for (int r = 0; r < MOE_TILE_M; ++r) {
        src[r] = 0;
    }
    for (int e = threadIdx.x >> 5; e < n_experts; e += warps) {
        const float v = moe_warp_rows_dot(router, (long long)e * d, router_code, normed, src, 1, d, lane);
        if (lane == 0) {
            logits[e] = v;
        }
    }
    if (slots != 0) {
        float* mine = slots + row * top_k * d;
        for (long long i = threadIdx.x; i < (long long)top_k * d; i += blockDim.x) {
            mine[i] = 0.0f;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        moec_route_topk(logits, n_experts, top_k, norm_p, 0, 0, route, (size_t)row);
    }
}

// The better of two (value, index) candidates: the larger value, the lower index on ties.
__device__ __forceinline__ void moe_argmax_take(float& value, unsigned int& index, float v,
                                                unsigned int i) {
    if (v > value || (v == value && i < index)) {
        value = v;
        index = i;
    }
}

// router.cuh's moec_route_topk for n <= 32 experts by one warp (lane e holds expert e):
// the max by a shuffle tree (fmaxf: any order gives the same), the exponentials' sum in
// expert order (every lane adds the broadcast values, so every lane holds the serial
// sum), each of the top_k picks an argmax over the lanes (the larger probability, the
// lower expert on ties: the serial scan's choice), the p-norm of the chosen in pick order;
// lane k stores pick k. The same route, bit for bit, as one thread's loops over local
// arrays, except that a NaN probability (a NaN logit) ranks below every number, where the
// serial scan keeps a NaN it meets first.
__device__ void moe_route_topk_warp(const float* logits, int n, int top_k, float norm_p,
                                    unsigned int* route, size_t token, int lane) {
    const float neg_inf = __int_as_float(0xff800000);
    const float lg = lane < n ? logits[lane] : neg_inf;
    float max = lg;
    for (int off = 16; off > 0; off >>= 1) {
        max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, off));
    }
    const float p = lane < n ? expf(lg - max) : 0.0f;
    float sum = 0.0f;
    for (int e = 0; e < n; ++e) {
        sum += __shfl_sync(0xffffffffu, p, e);
    }
    const float prob = p / sum;
    bool taken = false;
    unsigned int mine_e = 0;
    float mine_p = 0.0f;
    double acc = 0.0;
    for (int k = 0; k < top_k; ++k) {
        const bool candidate = lane < n && !taken;
        float value = candidate && prob == prob ? prob : neg_inf;
        unsigned int index = candidate ? (unsigned int)lane : 0xffffffffu;
        for (int off = 16; off > 0; off >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, value, off);
            const unsigned int i = __float_as_uint(__shfl_xor_sync(0xffffffffu, __uint_as_float(index), off));
            moe_argmax_take(value, index, v, i);
        }
        const float pk = __shfl_sync(0xffffffffu, prob, (int)index);
        if ((unsigned int)lane == index) {
            taken = true;
        }
        if (lane == k) {
            mine_e = index;
            mine_p = pk;
        }
        if (norm_p > 0.0f) {
            acc += pow(fabs((double)pk), (double)norm_p);
        }
    }
    const float denom = norm_p > 0.0f ? (float)pow(acc, 1.0 / (double)norm_p) : 1.0f;
    if (lane < top_k) {
        moec_route_store(0, 0, route, token * top_k + lane, mine_e, mine_p / denom);
    }
}

// Inputs of the gate's row kept in shared memory (moe_gate_route) up to this width.
#define MOE_GATE_STAGE 4096

// moe_gate_route_block with the same arguments, launch and values (bit for bit;
// router.cuh's route up to a NaN logit, see moe_route_topk_warp), its serial parts made
// parallel (MOEC_FLOAT_KERNELS=block runs the block form): each
// warp loads its first expert's router row (bf16/f16 routers on 16 bytes, d % 8 == 0)
// before the norm, so that round trip overlaps the norm's; the normalised row stays in
// shared memory for the router's products (d <= MOE_GATE_STAGE; else read back from
// x_norm) as well as going to x_norm; the softmax and top-k run on one warp's lanes
// (n_experts <= 32; else one thread as before) instead of one thread's loops over
// 256-entry local arrays.
extern "C" __global__ void moe_gate_route(
    const float* __restrict__ x,
    const void* __restrict__ norm_w,
    int norm_code,
    int layer_norm,
    float eps,
    const void* __restrict__ router,
    int router_code,
    float* __restrict__ x_norm,
    float* __restrict__ slots,
    unsigned int* __restrict__ route,
    int d,
    int n_experts,
    int top_k,
    float norm_p) {
    __shared__ float logits[ROUTER_MAX_EXPERTS];
    __shared__ __align__(16) float staged[MOE_GATE_STAGE];
    const long long row = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const bool half = (router_code == 0 || router_code == 1) && d % 8 == 0
                      && (unsigned long long)router % 16 == 0;
    const bool stage = d <= MOE_GATE_STAGE;
    uint4 raw[4];
    if (half && warp < n_experts) {
        moe_half_load4((const unsigned short*)router + (long long)warp * d, lane * 8, d, raw);
    }
    float* normed = x_norm + row * d;
    moec_norm_row(x + row * d, norm_w, norm_code, stage ? staged : normed, d, eps, layer_norm,
                  blockDim.x);
    if (stage) {
        // Each thread copies the values it wrote itself: no barrier needed for these.
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            normed[i] = staged[i];
        }
    }
    __syncthreads();
    const float* xn = stage ? staged : normed;
    const bool vec_x = (unsigned long long)xn % 16 == 0;
    for (int e = warp; e < n_experts; e += warps) {
        float v;
        if (half && vec_x) {
            const unsigned short* r = (const unsigned short*)router + (long long)e * d;
            if (e != warp) {
                moe_half_load4(r, lane * 8, d, raw);
            }
            float acc = 0.0f;
            for (int k = lane * 8; k < d; k += 1024) {
                if (k != lane * 8) {
                    moe_half_load4(r, k, d, raw);
                }
                acc = router_code == 0 ? moe_half_dot4<0, false>(raw, 0, k, d, xn, 0.0f, acc)
                                       : moe_half_dot4<1, false>(raw, 0, k, d, xn, 0.0f, acc);
            }
            v = moe_warp_sum(acc);
        } else {
            long long src[MOE_TILE_M];
#pragma unroll
            for (int r = 0; r < MOE_TILE_M; ++r) {
                src[r] = 0;
            }
            v = moe_warp_rows_dot(router, (long long)e * d, router_code, xn, src, 1, d, lane);
        }
        if (lane == 0) {
            logits[e] = v;
        }
    }
    if (slots != 0) {
        float* mine = slots + row * top_k * d;
        for (long long i = threadIdx.x; i < (long long)top_k * d; i += blockDim.x) {
            mine[i] = 0.0f;
        }
    }
    __syncthreads();
    if (n_experts <= 32) {
        if (warp == 0) {
            moe_route_topk_warp(logits, n_experts, top_k, norm_p, route, (size_t)row, lane);
        }
    } else if (threadIdx.x == 0) {
        moec_route_topk(logits, n_experts, top_k, norm_p, 0, 0, route, (size_t)row);
    }
}

// Integer warp helpers through __shfl_sync's int form (the CPU emulation has no integer
// xor or up shuffles): the sum over the warp, and the inclusive prefix sum over lanes.
__device__ __forceinline__ int moe_warp_sum_int(int v, int lane) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_sync(0xffffffffu, v, lane ^ off);
    }
    return v;
}

__device__ __forceinline__ int moe_warp_scan_int(int v, int lane) {
    for (int off = 1; off < 32; off <<= 1) {
        const int other = __shfl_sync(0xffffffffu, v, lane >= off ? lane - off : lane);
        if (lane >= off) {
            v += other;
        }
    }
    return v;
}

// moe_group_block's grouping (the same arguments and outputs: integers, equal), the
// route scanned 32 entries at a time by a warp per expert instead of one thread per
// expert walking every entry twice (128 entries, a batch-64 step or a 64-token prefill at
// top-2: 26 us on an H200): counts by warp sums, the experts' exclusive prefix sums
// (positions and tiles) by warp 0's scans 32 experts at a time, then each expert's
// positions in route order from each chunk's prefix of matches. Launch: grid 1, block
// 256 (experts <= 256, MOE_MAX_EXPERTS).
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
    __shared__ int counts[MOE_MAX_EXPERTS];
    __shared__ int offsets[MOE_MAX_EXPERTS];
    __shared__ int tile_offsets[MOE_MAX_EXPERTS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    for (int e = warp; e < experts; e += warps) {
        int count = 0;
        if (members[e] != 0) {
            for (long long base = 0; base < n_entries; base += 32) {
                const long long i = base + lane;
                const int hit = i < n_entries && route[2 * i] == (unsigned int)e;
                count += moe_warp_sum_int(hit, lane);
            }
        }
        if (lane == 0) {
            counts[e] = count;
        }
    }
    __syncthreads();
    if (warp == 0) {
        int positions = 0, n_tiles = 0;
        for (int e0 = 0; e0 < experts; e0 += 32) {
            const int e = e0 + lane;
            const int c = e < experts ? counts[e] : 0;
            const int t = (c + MOE_TILE_M - 1) / MOE_TILE_M;
            const int cs = moe_warp_scan_int(c, lane);
            const int ts = moe_warp_scan_int(t, lane);
            if (e < experts) {
                offsets[e] = positions + cs - c;
                tile_offsets[e] = n_tiles + ts - t;
            }
            positions += __shfl_sync(0xffffffffu, cs, 31);
            n_tiles += __shfl_sync(0xffffffffu, ts, 31);
        }
        if (lane == 0) {
            tiles[0] = n_tiles;
            tiles[1] = positions;
        }
    }
    __syncthreads();
    for (int e = warp; e < experts; e += warps) {
        const int c = counts[e];
        if (c == 0) {
            continue;
        }
        const int position = offsets[e];
        const int tile0 = tile_offsets[e];
        for (int t = lane; t * MOE_TILE_M < c; t += 32) {
            const int first = t * MOE_TILE_M;
            const int rest = c - first;
            tiles[2 + 3 * (tile0 + t)] = e;
            tiles[2 + 3 * (tile0 + t) + 1] = position + first;
            tiles[2 + 3 * (tile0 + t) + 2] = rest < MOE_TILE_M ? rest : MOE_TILE_M;
        }
        int at = position;
        for (long long base = 0; base < n_entries; base += 32) {
            const long long i = base + lane;
            const int hit = i < n_entries && route[2 * i] == (unsigned int)e;
            const int before = moe_warp_scan_int(hit, lane);
            if (hit) {
                const int p = at + before - 1;
                perm_row[p] = (unsigned int)(i / top_k);
                perm_slot[p] = (unsigned int)(i % top_k);
                perm_weight[p] = __uint_as_float(route[2 * i + 1]);
            }
            at += __shfl_sync(0xffffffffu, before, 31);
        }
    }
}
