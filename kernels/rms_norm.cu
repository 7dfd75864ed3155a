// Row normalisation of f32 activations with a stored per-channel weight, as
// src/math/norm.rs computes it:
//   rms_norm   (Mixtral RMSNorm)          out = w * (x * rsqrt(mean(x^2) + eps))
//   layer_norm (DBRX LayerNorm, no bias)  out = (x - mean) * rsqrt(var + eps) * w
// with the biased variance (divide by d), statistics in f32.
//
// Layout: x and out are [n_rows, d] f32, row-major, contiguous. weight is d values of
// `dtype` (the prelude's codes 0 bf16, 1 f16, 2 f32: Hub checkpoints store norms in bf16,
// GGUF files in f32), widened exactly by moec_load.
// Launch: grid = (n_rows), block = (threads), threads a multiple of 32 and <= 1024; one
// block normalises one row. The scale is 1 / sqrtf(...) as in the Rust kernel (not rsqrtf,
// which is approximate). Sums are reduced in a tree, so results agree with the CPU to
// rounding, not bit for bit.

extern "C" __global__ void rms_norm(
    const float* __restrict__ x,
    const void* __restrict__ weight,
    float* __restrict__ out,
    int d,
    float eps,
    int dtype) {
    const size_t row = blockIdx.x;
    const float* src = x + row * (size_t)d;
    float* dst = out + row * (size_t)d;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        sum_sq += src[i] * src[i];
    }
    const float mean_sq = moec_block_reduce(sum_sq, 0) / (float)d;
    const float scale = 1.0f / sqrtf(mean_sq + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        dst[i] = moec_load(weight, i, dtype) * (src[i] * scale);
    }
}

extern "C" __global__ void layer_norm(
    const float* __restrict__ x,
    const void* __restrict__ weight,
    float* __restrict__ out,
    int d,
    float eps,
    int dtype) {
    const size_t row = blockIdx.x;
    const float* src = x + row * (size_t)d;
    float* dst = out + row * (size_t)d;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        sum += src[i];
    }
    const float mean = moec_block_reduce(sum, 0) / (float)d;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float centred = src[i] - mean;
        sum_sq += centred * centred;
    }
    const float var = moec_block_reduce(sum_sq, 0) / (float)d;
    const float scale = 1.0f / sqrtf(var + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        dst[i] = (src[i] - mean) * scale * moec_load(weight, i, dtype);
    }
}

// Qwen3's per-head and OLMoE's whole-projection q/k RMSNorm, in place, on f32 rows of stride
// `ld`: each of `chunks` runs of `chunk` values starting at column `col` is normalised as
// rms_norm does (w * (x * 1/sqrt(mean + eps))) with the same `chunk` f32 weights.
// Launch: grid = (n_rows, chunks), block = (threads, a multiple of 32).
extern "C" __global__ void qk_rms_norm_f32(
    float* __restrict__ x,
    const float* __restrict__ weight,
    int ld,
    int col,
    int chunk,
    float eps) {
    const size_t row = blockIdx.x;
    float* part = x + row * (size_t)ld + col + (size_t)blockIdx.y * chunk;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
        sum_sq += part[i] * part[i];
    }
    // Every thread has read its values before any writes (the reduction's barriers).
    const float mean_sq = moec_block_reduce(sum_sq, 0) / (float)chunk;
    const float scale = 1.0f / sqrtf(mean_sq + eps);
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
        part[i] = weight[i] * (part[i] * scale);
    }
}
