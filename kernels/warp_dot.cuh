// Warp dot products of stored float-format rows with f32 activation rows, shared by
// moe_grouped.cu (moe_grouped_gemv, moe_grouped_gemv_1, the gate's router products) and
// linear_gemv.cu (linear_gemv, linear_gemv3 and their one-row forms):
//   moe_warp_rows_dot(_t)  a stored row (any prelude format, 16-byte loads where aligned)
//                          with up to MOE_TILE_M rows, optionally RMSNorm'd as read
//   moe_half_* / moe_dot*  one activation row with bf16/f16 weights, several 16-byte
//                          loads a lane in flight (the _1 kernels)
//   moe_rows_dot_staged    2-16 rows with bf16/f16 weights, a chunk's loads in flight and
//                          the rows staged in shared memory once a block (the _r4/_r16 ones)
// Needs moe_tiles.cuh (MOE_TILE_M) included before it.

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

// Eight 16-bit weights (format dt: 0 bf16, 1 f16) of a 16-byte load as f32.
__device__ __forceinline__ void moe_rows_widen(const uint4& raw, int dt, float* wv) {
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned short lo = (unsigned short)(words[j] & 0xffffu);
        const unsigned short hi = (unsigned short)(words[j] >> 16);
        wv[2 * j] = dt == 0 ? moec_bf16_to_f32(lo) : moec_f16_to_f32(lo);
        wv[2 * j + 1] = dt == 0 ? moec_bf16_to_f32(hi) : moec_f16_to_f32(hi);
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
            float wv[8];
            moe_rows_widen(raw[u], DT, wv);
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

// ---- 2-16 activation rows, 16-bit weights, rows staged in shared memory -----------------
// The generic loop above keeps one 16-byte weight load a lane in flight and re-reads each
// activation row from global memory in every warp: at 4 and 16 rows an H200 read a
// 14336x4096 bf16 projection at 977 and 405 GB/s of 3,542 at one row. This form takes the
// inputs in chunks of MOE_STAGE_FLOATS / R (R = 4: 2048, R = 16: 512): each lane issues
// all of its chunk's 16-byte weight loads (8 at R = 4, 2 at R = 16) first, then the block
// copies the chunk of the rows (normalised as read when `nw` is given: rms_norm's values)
// into shared memory once for its 8 warps, then the FMAs run from registers and shared
// memory. Lane l still owns inputs l * 8 + 256 u, each 8-term sum in the generic loop's
// expression and k ascending, and the same warp reduction: the sums are the generic
// loop's bit for bit. R is a compile-time row bound (accumulators in registers, no
// dynamic indexing); `rows` <= R at run time. Every thread of the block must call it (two
// barriers a chunk): a warp with no output passes w = 0 and gets 0.
#define MOE_STAGE_FLOATS 8192

// The 8-term product of widened weights wv with the 8 staged values at xs (16-byte
// aligned), summed left to right as the generic loop writes it: every staged kernel's sums
// keep the generic loop's bits because they all take this one expression.
__device__ __forceinline__ float moe_dot8(const float* wv, const float* xs) {
    const float4 a = *(const float4*)xs;
    const float4 b = *(const float4*)(xs + 4);
    return wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y
         + wv[6] * b.z + wv[7] * b.w;
}


template <int R>
__device__ float moe_rows_dot_staged(const unsigned short* __restrict__ w, int dt,
                                     const float* __restrict__ x, int rows, int in_dim,
                                     int lane, const void* nw, int nw_code, const float* scale,
                                     float* xs) {
    constexpr int KC = MOE_STAGE_FLOATS / R;
    constexpr int U = KC / 256;
    constexpr int Q = KC / 4;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    for (int c = 0; c < in_dim; c += KC) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = c + lane * 8 + 256 * u;
            if (w != 0 && k < in_dim) {
                raw[u] = *(const uint4*)(w + k);
            } else {
                raw[u].x = raw[u].y = raw[u].z = raw[u].w = 0u;
            }
        }
        for (int i = threadIdx.x; i < R * Q; i += blockDim.x) {
            const int r = i / Q;
            const int kk = 4 * (i % Q);
            const int k = c + kk;
            float4 v;
            v.x = v.y = v.z = v.w = 0.0f;
            if (r < rows && k < in_dim) {
                v = *(const float4*)(x + (long long)r * in_dim + k);
                if (nw != 0) {
                    const float s = scale[r];
                    v.x = moe_norm_at(nw, k, nw_code) * (v.x * s);
                    v.y = moe_norm_at(nw, k + 1, nw_code) * (v.y * s);
                    v.z = moe_norm_at(nw, k + 2, nw_code) * (v.z * s);
                    v.w = moe_norm_at(nw, k + 3, nw_code) * (v.w * s);
                }
            }
            *(float4*)(xs + r * KC + kk) = v;
        }
        __syncthreads();
        if (w != 0) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int kk = lane * 8 + 256 * u;
                if (c + kk < in_dim) {
                    float wv[8];
                    moe_rows_widen(raw[u], dt, wv);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (r < rows) {
                            acc[r] += moe_dot8(wv, xs + r * KC + kk);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r < rows) {
            acc[r] = moe_warp_sum(acc[r]);
        }
    }
    float v = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r == lane) {
            v = acc[r];
        }
    }
    return v;
}
