// The few-row dense float projections (a decode step's or a short prefill's q|k|v, o,
// router, shared expert and head: at most MOE_TILE_M activation rows), a warp per output
// feature over weights stored [out, in]:
//   linear_gemv          y[r] (=|+=) x[r] . W, any prelude format (quantised blocks decoded
//                        inside the product)
//   linear_gemv3         up to three such products of the same rows in one launch (q, k, v),
//                        optionally RMSNorm'ing the rows first (moe_warp_norm: rms_norm's bits)
//   linear_gemv_1, linear_gemv3_1
//                        their one-row forms for bf16/f16 weights (a batch-1 step)
//   linear_gemv_r4/_r16, linear_gemv3_r4/_r16
//                        their 2-4 / 5-16-row forms for bf16/f16 weights (loads in flight,
//                        rows staged in shared memory)
// The products are warp_dot.cuh's, as moe_grouped.cu's grouped kernels take them.

#include "moe_tiles.cuh"
#include "warp_dot.cuh"

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

// ---- 2-16 rows of bf16/f16 weights: moe_rows_dot_staged (warp_dot.cuh) ------------------
// linear_gemv and linear_gemv3 for 2 to R rows of bf16/f16 weights (codes 0/1, every
// matrix), weights and x on 16 bytes and in_dim % 8 == 0 (the host checks; no fallback
// inside): the weights' loads of a chunk all issued before the FMAs and the rows staged
// in shared memory once a block. The same arguments, launch shape and values (bit for
// bit) as the generic kernels; R = 4 for up to 4 rows, 16 beyond (two instances each, so
// NVRTC compiles two copies of the loop, not one per row count). The warps of a block
// run the chunks' barriers together, so a warp past the outputs still takes part.
template <int R>
__device__ __forceinline__ void linear_gemv_rows(const float* __restrict__ x,
                                                 const void* __restrict__ w,
                                                 float* __restrict__ y, int n, int in_dim,
                                                 int out_dim, int dtype, int ldy,
                                                 int accumulate) {
    __shared__ __align__(16) float xs[MOE_STAGE_FLOATS];
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    const int rows = n < R ? n : R;
    const unsigned short* row =
        o < out_dim ? (const unsigned short*)w + (long long)o * in_dim : 0;
    const float v = moe_rows_dot_staged<R>(row, dtype, x, rows, in_dim, lane, 0, 0, 0, xs);
    if (o >= out_dim || lane >= rows) {
        return;
    }
    float* out = y + (long long)lane * ldy + o;
    *out = accumulate ? *out + v : v;
}

extern "C" __global__ void linear_gemv_r4(
    const float* __restrict__ x,
    const void* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate) {
    linear_gemv_rows<4>(x, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
}

extern "C" __global__ void linear_gemv_r16(
    const float* __restrict__ x,
    const void* __restrict__ w,
    float* __restrict__ y,
    int n,
    int in_dim,
    int out_dim,
    int dtype,
    int ldy,
    int accumulate) {
    linear_gemv_rows<16>(x, w, y, n, in_dim, out_dim, dtype, ldy, accumulate);
}

// linear_gemv3 through moe_rows_dot_staged: the rows' RMSNorm scales first (linear_gemv3's
// warps-in-turn moe_warp_norm, one barrier), then the normalised rows staged per chunk.
template <int R>
__device__ __forceinline__ void linear_gemv3_rows(
    const float* __restrict__ x, const void* __restrict__ w0, const void* __restrict__ w1,
    const void* __restrict__ w2, int out0, int out1, int out2, int d0, int d1, int d2,
    float* __restrict__ y, int n, int in_dim, int ldy, int col1, int col2,
    const void* __restrict__ norm_w, int norm_code, float eps, int norm_threads) {
    __shared__ __align__(16) float xs[MOE_STAGE_FLOATS];
    __shared__ float scale[R];
    const int lane = threadIdx.x & 31;
    const int rows = n < R ? n : R;
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
    bool live = true;
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
            live = o < out2;
        }
    }
    const unsigned short* row = live ? (const unsigned short*)w + (long long)o * in_dim : 0;
    const float v = moe_rows_dot_staged<R>(row, dtype, x, rows, in_dim, lane, norm_w, norm_code,
                                           scale, xs);
    if (!live || lane >= rows) {
        return;
    }
    y[(long long)lane * ldy + col + o] = v;
}

extern "C" __global__ void linear_gemv3_r4(
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
    linear_gemv3_rows<4>(x, w0, w1, w2, out0, out1, out2, d0, d1, d2, y, n, in_dim, ldy, col1,
                         col2, norm_w, norm_code, eps, norm_threads);
}

extern "C" __global__ void linear_gemv3_r16(
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
    linear_gemv3_rows<16>(x, w0, w1, w2, out0, out1, out2, d0, d1, d2, y, n, in_dim, ldy, col1,
                          col2, norm_w, norm_code, eps, norm_threads);
}
