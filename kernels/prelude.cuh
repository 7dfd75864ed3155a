// Prepended to every kernels/*.cu file before NVRTC compiles it (runtime::cuda::kernels::
// PRELUDE), so each file's kernels share one copy of these: the stored weight formats
// decoded to f32 exactly as the CPU kernels decode them (half::bf16 / half::f16), and the
// block-wide reduction the norms and attention kernels use.
// dtype codes: 0 bf16, 1 f16, 2 f32.

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

// Element i of a stored matrix in format `dtype`, as f32.
__device__ __forceinline__ float moec_load(const void* base, long long i, int dtype) {
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
