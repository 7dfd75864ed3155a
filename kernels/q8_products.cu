// Integer products on 8-bit activations (the generic kernels: any row count up to
// MOE_TILE_M at run time; q8_products_rows.cu holds the row-count-specialised ones the host
// runs by default, MOEC_Q8_KERNELS=generic these):
//   linear_gemv_q8, moe_grouped_gemv_q8, linear_gemv3_q8
//                        linear_gemv's, moe_grouped_gemv's and linear_gemv3's products over
//                        q8_quantize's rows.

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

#include "moe_tiles.cuh"
#include "q8_units.cuh"

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
