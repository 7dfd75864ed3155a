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

// ggml's nearest_int: round half to even through the 1.5 * 2^23 trick (src/quant/q8.rs).
__device__ __forceinline__ int moec_nearest_int(float v) {
    const float biased = v + 12582912.0f;
    return (int)(__float_as_uint(biased) & 0x007fffffu) - 0x00400000;
}

// The binary16 value nearest to v (ties to even), as f32: half::f16::from_f32(v).to_f32().
__device__ __forceinline__ float moec_round_f16(float v) {
    const unsigned int sign = __float_as_uint(v) & 0x80000000u;
    const float a = fabsf(v);
    if (a != a) {
        return v;
    }
    if (a >= 65520.0f) {
        return __uint_as_float(sign | 0x7f800000u);
    }
    float r;
    if (a < 6.103515625e-05f) {
        // Subnormal binary16: multiples of 2^-24 (both scalings exact).
        r = __fmul_rn(rintf(__fmul_rn(a, 16777216.0f)), 5.9604644775390625e-8f);
    } else {
        unsigned int bits = __float_as_uint(a);
        bits += 0x0fffu + ((bits >> 13) & 1u);
        r = __uint_as_float(bits & ~0x1fffu);
    }
    return __uint_as_float(sign | __float_as_uint(r));
}

// One warp's block of `block` values at xb (8 values a lane for Q8_K, 1 for Q8_0): the
// lane's codes in q[0 .. per_lane) and the block's scale (every lane the same), as the
// CPU's Q8Rows::quantize makes them (Q8_K: a block of zeros has codes 0 and scale 0).
// Every lane of the warp calls it (it shuffles).
__device__ __forceinline__ float moec_q8_block(const float* xb, int kind, int lane, int* q) {
    const int block = kind == 0 ? 256 : 32;
    const int per_lane = block / 32;
    // The block's first value of largest magnitude (as the CPU's in-order scan finds
    // it): each lane scans its own values in order, then the warp keeps the larger
    // magnitude, the lower index on a tie. A total order, so every lane ends with the
    // same (amax, max); NaN never wins a comparison, as in the scan.
    float v[8];
    float amax = 0.0f;
    float max = 0.0f;
    int at = block;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (i < per_lane) {
            v[i] = xb[lane * per_lane + i];
            const float a = fabsf(v[i]);
            if (a > amax) {
                amax = a;
                max = v[i];
                at = lane * per_lane + i;
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float other_amax = __shfl_xor_sync(0xffffffffu, amax, off);
        const float other_max = __shfl_xor_sync(0xffffffffu, max, off);
        const int other_at = __shfl_xor_sync(0xffffffffu, at, off);
        if (other_amax > amax || (other_amax == amax && other_at < at)) {
            amax = other_amax;
            max = other_max;
            at = other_at;
        }
    }
    if (kind == 0) {
        if (amax == 0.0f) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                q[i] = 0;
            }
            return 0.0f;
        }
        const float iscale = -127.0f / max;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (i < per_lane) {
                const int n = moec_nearest_int(__fmul_rn(iscale, v[i]));
                q[i] = (int)(signed char)(n < 127 ? n : 127);
            }
        }
        return 1.0f / iscale;
    }
    const float d = moec_round_f16(amax / 127.0f);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (i < per_lane) {
            // Through an integer, as the CPU's i8 codes: -0.4 gives code 0, not -0.
            q[i] = (int)fminf(127.0f, fmaxf(-128.0f, rintf(__fmul_rn(v[i], id))));
        }
    }
    return d;
}

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

// Activation rows quantised once for the integer products (moe_grouped.cu's
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
