// Activation rows rounded through ggml's 8-bit activation formats, so a product of
// block-quantised weights on the device multiplies the values the CPU's default product
// (src/quant/q8.rs, `MOEC_QUANT_PRODUCT=int8`) multiplies: each block's codes times
// its scale, written back as f32. The products that follow (linear_gemv, the grouped MoE
// kernels, dequant_f32 + cuBLAS) then compute Σ w_i (scale q_i), the CPU's Σ (scale w_i q_i)
// up to f32 rounding and summation order.
//   q8_roundtrip   y = x rounded per block of `block` values: kind 0 Q8_K (256 values:
//                  `max` the first value of largest magnitude, iscale = -127 / max, codes
//                  min(127, nearest_int(iscale x)), scale 1 / iscale; a block of zeros stays
//                  zero), kind 1 Q8_0 (32 values: scale = amax / 127 rounded to f16, codes
//                  round_half_even(x * 127 / amax))
// Products are rounded on their own (__fmul_rn): NVRTC would otherwise fuse `iscale * x`
// into the add that rounds it to an integer.
// Layout: x holds rows `x_row` floats apart, each `heads` slices of `width` values `x_head`
// floats apart (a plain product: heads 1, width = x_row); y is those slices packed,
// [rows, heads, width]. `width` is whole blocks. `live` (0: none): a device count of the
// rows that hold values (grouped expert activations: positions past the routed ones of the
// task's experts are never written); rows at or past it are neither read nor written.
// Launch: any 1-D grid of whole warps, one warp per block of values (8 values a lane for
// Q8_K, 1 for Q8_0), grid-stride over `n_blocks`. (A thread per block, as first written, left
// a decode step's 1024-value rows to 4 threads: 24 us a launch on an H100.)

// moec_q8_block (one warp's block of codes and its scale, the CPU's Q8Rows::quantize)
// lives in q8_block.cuh: q8_products_rows.cu's one-row integer products quantise their row
// with it too.
#include "q8_block.cuh"

extern "C" __global__ void q8_roundtrip(
    const float* __restrict__ x,
    long long x_row,
    long long x_head,
    int heads,
    int width,
    float* __restrict__ y,
    long long n_blocks,
    int kind,
    const int* __restrict__ live) {
    const int block = kind == 0 ? 256 : 32;
    const int per_lane = block / 32;
    const int lane = threadIdx.x & 31;
    const long long per_head = width / block;
    if (live != 0 && (long long)*live * heads * per_head < n_blocks) {
        n_blocks = (long long)*live * heads * per_head;
    }
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < n_blocks;
         b += warps) {
        const long long r = b / (per_head * heads);
        const long long h = (b / per_head) % heads;
        const float* xb = x + r * x_row + h * x_head + (b % per_head) * block;
        float* yb = y + b * block + lane * per_lane;
        int q[8];
        const float scale = moec_q8_block(xb, kind, lane, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (i < per_lane) {
                yb[i] = __fmul_rn(scale, (float)q[i]);
            }
        }
    }
}

// Activation rows quantised once for the integer products (q8_products*.cu's
// linear_gemv_q8 / moe_grouped_gemv_q8), every consumer of the same input sharing them:
// `codes` [rows, width] int8 and `scales` [rows, width / block] f32, the CPU's Q8Rows
// codes and scales (kind 0 Q8_K, 1 Q8_0; see moec_q8_block). x rows are `x_row` floats
// apart; `width` is whole blocks. `live` (0: none): a device count of the rows that hold
// values (a grouped activation whose positions past the routed ones were never written);
// rows at or past it are neither read nor written, and no product reads them.
// Launch: any 1-D grid of whole warps, one warp per block, grid-stride.
extern "C" __global__ void q8_quantize(
    const float* __restrict__ x,
    long long x_row,
    int width,
    long long rows,
    const int* __restrict__ live,
    signed char* __restrict__ codes,
    float* __restrict__ scales,
    int kind) {
    const int block = kind == 0 ? 256 : 32;
    const int per_lane = block / 32;
    const int lane = threadIdx.x & 31;
    const long long per_row = width / block;
    long long n_rows = rows;
    if (live != 0 && (long long)*live < n_rows) {
        n_rows = *live;
    }
    const long long n_blocks = n_rows * per_row;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < n_blocks;
         b += warps) {
        const long long r = b / per_row;
        const float* xb = x + r * x_row + (b % per_row) * block;
        int q[8];
        const float scale = moec_q8_block(xb, kind, lane, q);
        signed char* cb = codes + b * block + lane * per_lane;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (i < per_lane) {
                cb[i] = (signed char)q[i];
            }
        }
        if (lane == 0) {
            scales[b] = scale;
        }
    }
}
