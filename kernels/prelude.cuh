// Prepended to every kernels/*.cu file before NVRTC compiles it (runtime::cuda::kernels::
// PRELUDE), so each file's kernels share one copy of these: the stored weight formats
// decoded to f32 exactly as the CPU kernels decode them (half::bf16 / half::f16), and the
// block-wide reduction the norms and attention kernels use.
// dtype codes: 0 bf16, 1 f16, 2 f32, 3 Q8_0, 4 Q4_K, 5 Q5_K, 6 Q6_K, 7 Q4_0, 8 Q4_1,
// 9 MXFP4.

__device__ __forceinline__ float moec_bf16_to_f32(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}

// IEEE binary16 to f32, exactly (normals, subnormals, infinities, NaN).
__device__ __forceinline__ float moec_f16_to_f32(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int exponent = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mantissa = (unsigned int)h & 0x3ffu;
    if (exponent == 0x1fu) {
        return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    }
    if (exponent == 0) {
        if (mantissa == 0) {
            return __uint_as_float(sign);
        }
        // Subnormal: value = mantissa * 2^-24, exact in f32.
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Block-quantised weights (dtype codes 3 Q8_0, 4 Q4_K, 5 Q5_K, 6 Q6_K; 7 Q4_0, 8 Q4_1 and
// 9 MXFP4 in their own parts below), ggml's block layouts as src/quant/blocks.rs decodes
// them. A quantised matrix is stored [out, in]
// with rows of whole blocks, so element i of the matrix is weight i % elems of block
// i / elems counted from the start: no row stride is needed. Products and differences are
// rounded one at a time (__fmul_rn, __fsub_rn: NVRTC would otherwise contract
// `scale * q - min` into one fused multiply-add), so a weight decodes to the CPU's bits.
__device__ __forceinline__ int moec_quant_block_elems(int dtype) {
    return (dtype == 3 || dtype >= 7) ? 32 : 256;
}

__device__ __forceinline__ int moec_quant_block_bytes(int dtype) {
    switch (dtype) {
    case 3: return 34;
    case 4: return 144;
    case 5: return 176;
    case 6: return 210;
    case 7: return 18;
    case 8: return 20;
    default: return 17;
    }
}

__device__ __forceinline__ float moec_f16_at(const unsigned char* p) {
    return moec_f16_to_f32((unsigned short)(p[0] | ((unsigned int)p[1] << 8)));
}

// ---- Group-wise int4 (dtype codes 7 Q4_0, 8 Q4_1): blocks of 32 weights ----------------
// ggml's block_q4_0 (f16 d, 16 code bytes; weight = d * (q - 8)) and block_q4_1 (f16 d and
// m, 16 code bytes; weight = d * q + m, rounded product then rounded sum), as
// src/quant/blocks.rs decodes them: weights 0..16 are the low nibbles of the code
// bytes, weights 16..32 their high nibbles, so an 8-run (e0 a multiple of 8) shares one
// nibble half.
__device__ __forceinline__ void moec_q4_decode(const unsigned char* b, int dtype, int e0, int n, float* v) {
    const float d = moec_f16_at(b);
    const unsigned char* qs = b + (dtype == 7 ? 2 : 4);
    const int shift = 4 * (e0 / 16);
    for (int i = 0; i < n; ++i) {
        const int q = (qs[(e0 + i) % 16] >> shift) & 0x0f;
        v[i] = dtype == 7 ? __fmul_rn(d, (float)(q - 8)) : __fadd_rn(__fmul_rn(d, (float)q), moec_f16_at(b + 2));
    }
}
// ---- end of group-wise int4 -------------------------------------------------------------

// ---- MXFP4 (dtype code 9): blocks of 32 weights -----------------------------------------
// ggml's block_mxfp4: one e8m0 exponent byte e, then 16 code bytes in Q4_0's nibble order;
// weight = kvalues_mxfp4[q] * 2^(e - 128) (twice the e2m1 value times half the scale, as
// ggml_e8m0_to_fp32_half builds it from bits), exact, as src/quant/blocks.rs decodes.
__device__ __forceinline__ void moec_mxfp4_decode(const unsigned char* b, int e0, int n, float* v) {
    const unsigned int e = b[0];
    const float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
    const int shift = 4 * (e0 / 16);
    for (int i = 0; i < n; ++i) {
        const int q = (b[1 + (e0 + i) % 16] >> shift) & 0x0f;
        const int mag = (q & 7) < 4 ? (q & 7) : ((q & 7) < 6 ? 2 * (q & 7) - 4 : 4 * (q & 7) - 16);
        v[i] = __fmul_rn(d, (float)(q & 8 ? -mag : mag));
    }
}
// ---- end of MXFP4 -----------------------------------------------------------------------

// The 6-bit scale and min of sub-block j (0..8) of a Q4_K/Q5_K block from its 12 packed
// scale bytes, byte n as `byte(n)` gives it (blocks.rs scale_min_k4): read from memory, or
// picked out of words already loaded (warp_dot.cuh's word-load decode).
template <class ByteAt>
__device__ __forceinline__ void moec_scale_min_k4(int j, ByteAt byte, int* sc, int* m) {
    if (j < 4) {
        *sc = (int)(byte(j) & 63u);
        *m = (int)(byte(j + 4) & 63u);
    } else {
        *sc = (int)((byte(j + 4) & 0x0fu) | ((byte(j - 4) >> 6) << 4));
        *m = (int)((byte(j + 4) >> 4) | ((byte(j) >> 6) << 4));
    }
}

// Weights e0 .. e0 + n - 1 of the block at b into v, with n 1 or 8 and an 8-run starting
// at a multiple of 8 (so the run shares one sub-block and one scale in every format).
__device__ __forceinline__ void moec_quant_decode(const unsigned char* b, int dtype, int e0, int n, float* v) {
    if (dtype == 9) {
        moec_mxfp4_decode(b, e0, n, v);
    } else if (dtype >= 7) {
        moec_q4_decode(b, dtype, e0, n, v);
    } else if (dtype == 3) {
        const float d = moec_f16_at(b);
        for (int i = 0; i < n; ++i) {
            v[i] = __fmul_rn(d, (float)(signed char)b[2 + e0 + i]);
        }
    } else if (dtype == 4 || dtype == 5) {
        const int j = e0 / 32;
        const int l0 = e0 % 32;
        int sc, m;
        const unsigned char* packed = b + 4;
        moec_scale_min_k4(j, [packed](int n) { return (unsigned int)packed[n]; }, &sc, &m);
        const float scale = __fmul_rn(moec_f16_at(b), (float)sc);
        const float min = __fmul_rn(moec_f16_at(b + 2), (float)m);
        const unsigned char* qs = b + (dtype == 4 ? 16 : 48) + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < n; ++i) {
            const int l = l0 + i;
            int q = (qs[l] >> shift) & 0x0f;
            if (dtype == 5) {
                q |= ((b[16 + l] >> j) & 1) << 4;
            }
            v[i] = __fsub_rn(__fmul_rn(scale, (float)q), min);
        }
    } else {
        const int half = e0 / 128;
        const int s = (e0 % 128) / 32;
        const int l0 = e0 % 32;
        const unsigned char* ql = b + 64 * half + 32 * (s % 2);
        const unsigned char* qh = b + 128 + 32 * half;
        const float d = moec_f16_at(b + 208);
        const float scale = __fmul_rn(d, (float)(signed char)b[192 + 8 * half + 2 * s + l0 / 16]);
        for (int i = 0; i < n; ++i) {
            const int l = l0 + i;
            const int low = (ql[l] >> (4 * (s / 2))) & 0x0f;
            const int high = (qh[l] >> (2 * s)) & 3;
            v[i] = __fmul_rn(scale, (float)((low | (high << 4)) - 32));
        }
    }
}

// Weights i .. i + n - 1 (n 1 or 8, i a multiple of n) of a quantised matrix at base.
__device__ __forceinline__ void moec_quant_load(const void* base, long long i, int dtype, int n, float* v) {
    const long long elems = moec_quant_block_elems(dtype);
    const unsigned char* block = (const unsigned char*)base + (i / elems) * moec_quant_block_bytes(dtype);
    moec_quant_decode(block, dtype, (int)(i % elems), n, v);
}

// Element i of a stored matrix in format `dtype`, as f32.
__device__ __forceinline__ float moec_load(const void* base, long long i, int dtype) {
    if (dtype >= 3) {
        float v;
        moec_quant_load(base, i, dtype, 1, &v);
        return v;
    }
    if (dtype == 2) {
        return ((const float*)base)[i];
    }
    const unsigned short bits = ((const unsigned short*)base)[i];
    return dtype == 0 ? moec_bf16_to_f32(bits) : moec_f16_to_f32(bits);
}

// Reduces `value` over the block with `op` (0: sum, 1: max); every thread gets the result.
// Warps reduce as trees, then warp 0 reduces the warps' results, so sums agree with the
// CPU's in-order sums to rounding, not bit for bit.
__device__ float moec_block_reduce(float value, int op) {
    __shared__ float warp_parts[32];
    __shared__ float total;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = op == 0 ? value + other : fmaxf(value, other);
    }
    if (lane == 0) {
        warp_parts[warp] = value;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned int n_warps = (blockDim.x + 31) / 32;
        const float identity = op == 0 ? 0.0f : __int_as_float(0xff800000);
        float part = lane < n_warps ? warp_parts[lane] : identity;
        for (int offset = 16; offset > 0; offset /= 2) {
            const float other = __shfl_xor_sync(0xffffffffu, part, offset);
            part = op == 0 ? part + other : fmaxf(part, other);
        }
        if (lane == 0) {
            total = part;
        }
    }
    __syncthreads();
    const float result = total;
    __syncthreads();
    return result;
}

// One row's normalisation as rms_norm.cu's kernels compute it (`layer_norm` 0: RMSNorm,
// out = w * (x * 1 / sqrt(mean(x^2) + eps)); 1: LayerNorm without bias, out = (x - mean) *
// scale * w), by the first `threads` threads of the block (a multiple of 32), which every
// thread of the block calls (the reductions need them all; the others add nothing). With
// `threads` the block size of rms_norm's launch, a kernel that normalises inside itself
// gets that kernel's bits: the extra warps add exact zeros at the same places of the
// reduction tree. `out` (null: not written) gets the row; gives the scale (RMSNorm's is
// all a caller needs to normalise a value itself: w * (x * scale)).
__device__ float moec_norm_row(const float* src, const void* weight, int dtype, float* out,
                               int d, float eps, int layer_norm, int threads) {
    const int t = (int)threadIdx.x;
    const bool mine = t < threads;
    float mean = 0.0f;
    if (layer_norm) {
        float sum = 0.0f;
        for (int i = t; mine && i < d; i += threads) {
            sum += src[i];
        }
        mean = moec_block_reduce(sum, 0) / (float)d;
    }
    float sum_sq = 0.0f;
    for (int i = t; mine && i < d; i += threads) {
        const float v = layer_norm ? src[i] - mean : src[i];
        sum_sq += v * v;
    }
    const float scale = 1.0f / sqrtf(moec_block_reduce(sum_sq, 0) / (float)d + eps);
    if (out != 0) {
        for (int i = t; mine && i < d; i += threads) {
            out[i] = layer_norm ? (src[i] - mean) * scale * moec_load(weight, i, dtype)
                                : moec_load(weight, i, dtype) * (src[i] * scale);
        }
    }
    return scale;
}
