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
//
// Also here: moe_grouped_gemv (the few-row form, a warp per (tile, output)), moe_grouped_mma
// (bf16 experts on tensor cores), moe_grouped_gemv_1 (one-row tiles, bf16/f16),
// moe_grouped_gemv_rows (2-16-row tiles, bf16/f16: rows staged, split-K), and the MoE
// gate in one launch (moe_gate_route, moe_gate_route_block). The dense few-row products are
// in linear_gemv.cu, the integer products on 8-bit activations in q8_products.cu and
// q8_products_rows.cu; the helpers they share with this file in moe_tiles.cuh and
// warp_dot.cuh.

#include "router.cuh"
#include "tensor_core.cuh"
#include "moe_tiles.cuh"
#include "warp_dot.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_TILE_N 64
#define MOE_TILE_K 32
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

// ---- 2-16 rows per expert, 16-bit weights, rows staged: moe_grouped_gemv_rows -----------
// moe_grouped_gemv for tiles of 2-16 rows (decode steps of 2-64 tokens below the tensor-core
// threshold, f16 experts, small prefills) with bf16/f16 weights stored [out, in], weights
// and x on 16 bytes and in_dim % 8 == 0 (the host checks; no fallback inside). What the
// generic form spends its time on at these rows: one 16-byte weight load a lane in flight
// (a 3584-wide down projection 14 round trips deep, gate then up another 2 x 4), every warp
// re-reading its tile's rows from global memory, and a grid of (max tiles, out / 8) whose
// blocks past the tile count exit at once. Here:
//   - linear_gemv_r4/_r16's staging (moe_rows_dot_staged): each lane issues all its weight
//     loads of a chunk of MOE_STAGE_FLOATS / R inputs (8 at R = 4, 2 at R = 16) before
//     the block copies the chunk of the tile's rows (gathered through perm_row) into shared
//     memory once for its 8 warps; then the FMAs from registers and shared memory;
//   - each warp multiplies two stored rows against every staged value it reads: the gate
//     and up rows of one output in mode 3 (gate, up and SwiGLU in one launch, as
//     moe_grouped_gemv_1), two consecutive outputs in modes 0-2, so shared-memory reads per
//     weight are half of one row's (at 16 rows they, not HBM, bound the product);
//   - the grid is (output blocks, slots): each block walks the tiles slot, slot + slots, ...
//     (the host sizes `slots` from the routed entries: at most the tiles there must be, so
//     no block finds no tile when every routed entry is the group's);
//   - R = 4 or 16 (the row bound the accumulators are compiled for) is chosen per tile from
//     its rows (block-uniform): a batch-16 step's 2-4-row tiles take 8 loads a lane in
//     flight even where another expert got 9 rows;
//   - split-K across warps: `split` (1, 2, 4 or 8) warps share an output (pair), each
//     taking the chunk's loads u with u % split == its index, the partial sums added in
//     warp order through shared memory, where out_dim is too small to give the GPU a block
//     an SM (the host picks it: moe.rs's `split_warps`).
// With split 1 each lane owns the generic loop's inputs (k = lane * 8 + 256 u, ascending),
// 8-term expressions and warp reduction: the sums are moe_grouped_gemv's bit for bit; with
// split > 1 they are f32 sums in another order (deterministic). Same arguments, tables,
// tiles and epilogues (modes 0-3, biases in modes 0-2) as moe_grouped_gemv, plus `split`.
// Launch: grid (ceil(out_dim / (per_warp * MOE_GEMV_WARPS / split)), slots), per_warp = 1
// in mode 3 and 2 otherwise; block 32 * MOE_GEMV_WARPS.

// A lane's 16-byte loads of stored row w in chunk c: inputs c + lane * 8 + 256 u for the
// u of its split index s (u % split == s); zeros elsewhere and for a null row.
template <int U>
__device__ __forceinline__ void moe_rows_load(const unsigned short* __restrict__ w, int c,
                                              int lane, int in_dim, int split, int s,
                                              uint4* raw) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = c + lane * 8 + 256 * u;
        if (w != 0 && u % split == s && k < in_dim) {
            raw[u] = *(const uint4*)(w + k);
        } else {
            raw[u].x = raw[u].y = raw[u].z = raw[u].w = 0u;
        }
    }
}

// One tile's products of stored rows w0 and w1 (either may be null: no loads, sums 0)
// with its `rows` (<= R) staged rows x + src[r] (src: element offsets in shared memory),
// over in_dim inputs; lane r (< rows) gets row r's warp sums in v0 and v1. Every thread of
// the block calls it (two barriers a chunk).
template <int R>
__device__ __forceinline__ void moe_rows_tile(const unsigned short* __restrict__ w0,
                                              const unsigned short* __restrict__ w1, int dt,
                                              const float* __restrict__ x,
                                              const long long* src, int rows, int in_dim,
                                              int split, int s, int lane, float* xs,
                                              float* v0, float* v1) {
    constexpr int KC = MOE_STAGE_FLOATS / R;
    constexpr int U = KC / 256;
    constexpr int Q = KC / 4;
    float a0[R], a1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        a0[r] = 0.0f;
        a1[r] = 0.0f;
    }
    for (int c = 0; c < in_dim; c += KC) {
        uint4 r0[U], r1[U];
        moe_rows_load<U>(w0, c, lane, in_dim, split, s, r0);
        moe_rows_load<U>(w1, c, lane, in_dim, split, s, r1);
        for (int i = threadIdx.x; i < rows * Q; i += blockDim.x) {
            const int r = i / Q;
            const int kk = 4 * (i % Q);
            float4 v;
            v.x = v.y = v.z = v.w = 0.0f;
            if (c + kk < in_dim) {
                v = *(const float4*)(x + src[r] + c + kk);
            }
            *(float4*)(xs + r * KC + kk) = v;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kk = lane * 8 + 256 * u;
            if (u % split == s && c + kk < in_dim) {
                float g[8], h[8];
                moe_rows_widen(r0[u], dt, g);
                moe_rows_widen(r1[u], dt, h);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r < rows) {
                        a0[r] += moe_dot8(g, xs + r * KC + kk);
                        a1[r] += moe_dot8(h, xs + r * KC + kk);
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r < rows) {
            a0[r] = moe_warp_sum(a0[r]);
            a1[r] = moe_warp_sum(a1[r]);
        }
    }
    float p0 = 0.0f, p1 = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r == lane) {
            p0 = a0[r];
            p1 = a1[r];
        }
    }
    *v0 = p0;
    *v1 = p1;
}

extern "C" __global__ void moe_grouped_gemv_rows(
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
    int top_k,
    int split) {
    __shared__ __align__(16) float xs[MOE_STAGE_FLOATS];
    __shared__ long long src[MOE_TILE_M];
    __shared__ float partial[2][MOE_GEMV_WARPS][MOE_TILE_M];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int s = warp % split;
    const int per_warp = mode == 3 ? 1 : 2;
    // The warp's first output: its group of `split` warps, `per_warp` outputs a group.
    const int o = (blockIdx.x * (MOE_GEMV_WARPS / split) + warp / split) * per_warp;
    const int n_tiles = tiles[0];
    for (int tile = blockIdx.y; tile < n_tiles; tile += gridDim.y) {
        const int expert = tiles[2 + 3 * tile];
        const int first = tiles[2 + 3 * tile + 1];
        const int rows = tiles[2 + 3 * tile + 2];
        // The rows' offsets in x, once a tile; the barrier also keeps this tile's writes
        // after every warp's use of the last tile's (src, partial).
        if (threadIdx.x < rows) {
            const int p = first + threadIdx.x;
            src[threadIdx.x] = (gather ? (long long)perm_row[p] : (long long)p) * in_dim;
        }
        __syncthreads();
        const unsigned short* w = (const unsigned short*)weights[expert];
        const unsigned short* w0 = o < out_dim ? w + (long long)o * in_dim : 0;
        const unsigned short* w1 =
            mode == 3 ? (o < out_dim ? (const unsigned short*)weights2[expert] + (long long)o * in_dim : 0)
                      : (o + 1 < out_dim ? w + (long long)(o + 1) * in_dim : 0);
        float v0, v1;
        if (rows <= 4) {
            moe_rows_tile<4>(w0, w1, dtype, x, src, rows, in_dim, split, s, lane, xs, &v0, &v1);
        } else {
            moe_rows_tile<16>(w0, w1, dtype, x, src, rows, in_dim, split, s, lane, xs, &v0, &v1);
        }
        if (split > 1) {
            // The group's partial sums in warp order (deterministic).
            if (lane < rows) {
                partial[0][warp][lane] = v0;
                partial[1][warp][lane] = v1;
            }
            __syncthreads();
            if (s == 0 && lane < rows) {
                for (int j = 1; j < split; ++j) {
                    v0 += partial[0][warp + j][lane];
                    v1 += partial[1][warp + j][lane];
                }
            }
        }
        if (s != 0 || lane >= rows || o >= out_dim) {
            continue;
        }
        const unsigned long long b = biases != 0 ? biases[expert] : 0ull;
        const long long p = first + lane;
        v0 += b != 0 ? moec_load((const void*)b, o, bias_dtype) : 0.0f;
        if (mode == 3) {
            moe_store(y, p, o, out_dim, mode, v0, v1, perm_row, perm_slot, perm_weight, top_k);
            continue;
        }
        moe_store(y, p, o, out_dim, mode, v0, 0.0f, perm_row, perm_slot, perm_weight, top_k);
        if (o + 1 < out_dim) {
            v1 += b != 0 ? moec_load((const void*)b, o + 1, bias_dtype) : 0.0f;
            moe_store(y, p, o + 1, out_dim, mode, v1, 0.0f, perm_row, perm_slot, perm_weight,
                      top_k);
        }
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
