// Integer products with the row count fixed at compile time (the default), the entries
// linear_gemv_q8_r1/_r16/_x1, linear_gemv3_q8_r1/_r16/_x1, moe_grouped_gemv_q8_r1/_r16/_x1
// (_x1: one row that the kernel quantises itself, q8_block.cuh's moec_q8_block).

// q8_products.cu's kernels keep MOE_TILE_M accumulators, row offsets and a 4-deep unrolled unit
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
// The sums are q8_products.cu's kernels' up to f32 summation order (per unit, then per lane in
// unit order, then the warp's xor reduction).

#include "moe_tiles.cuh"
#include "q8_units.cuh"
#include "q8_block.cuh"

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
