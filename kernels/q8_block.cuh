// One block of an activation row quantised to ggml's 8-bit activation formats by a warp,
// as the CPU's Q8Rows::quantize (src/quant/q8.rs) does it: shared by activations_q8.cu
// (q8_roundtrip, q8_quantize) and q8_products_rows.cu's one-row integer products, which
// quantise their row themselves (the *_q8_x1 kernels), so both give the CPU's codes.

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
