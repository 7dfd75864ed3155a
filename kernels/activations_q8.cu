// Activation rows rounded through ggml's 8-bit activation formats, so a product of
// block-quantised weights on the device multiplies the values the CPU's default product
// (src/model/quant/q8.rs, `MOEC_QUANT_PRODUCT=int8`) multiplies: each block's codes times
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
// [rows, heads, width]. `width` is whole blocks.
// Launch: any 1-D grid, one thread per block of values, grid-stride over `n_blocks`.

// ggml's nearest_int: round half to even through the 1.5 * 2^23 trick (src/model/quant/q8.rs).
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

extern "C" __global__ void q8_roundtrip(
    const float* __restrict__ x,
    long long x_row,
    long long x_head,
    int heads,
    int width,
    float* __restrict__ y,
    long long n_blocks,
    int kind) {
    const int block = kind == 0 ? 256 : 32;
    const long long per_head = width / block;
    for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const long long r = b / (per_head * heads);
        const long long h = (b / per_head) % heads;
        const float* xb = x + r * x_row + h * x_head + (b % per_head) * block;
        float* yb = y + b * block;
        float amax = 0.0f;
        float max = 0.0f;
        for (int i = 0; i < block; ++i) {
            const float a = fabsf(xb[i]);
            if (a > amax) {
                amax = a;
                max = xb[i];
            }
        }
        if (kind == 0) {
            if (amax == 0.0f) {
                for (int i = 0; i < block; ++i) {
                    yb[i] = 0.0f;
                }
                continue;
            }
            const float iscale = -127.0f / max;
            const float scale = 1.0f / iscale;
            for (int i = 0; i < block; ++i) {
                const int n = moec_nearest_int(__fmul_rn(iscale, xb[i]));
                const int q = n < 127 ? n : 127;
                yb[i] = __fmul_rn(scale, (float)(signed char)q);
            }
        } else {
            const float d = moec_round_f16(amax / 127.0f);
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < block; ++i) {
                // Through an integer, as the CPU's i8 codes: -0.4 gives code 0, not -0.
                const int r = (int)fminf(127.0f, fmaxf(-128.0f, rintf(__fmul_rn(xb[i], id))));
                yb[i] = __fmul_rn(d, (float)r);
            }
        }
    }
}
