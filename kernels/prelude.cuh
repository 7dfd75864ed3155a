// Prepended to every kernels/*.cu file before NVRTC compiles it (runtime::cuda::kernels::
// PRELUDE), so each file's kernels share one copy of these: the stored weight formats
// decoded to f32 exactly as the CPU kernels decode them (half::bf16 / half::f16).
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
