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
    moec_norm_row(x + row * (size_t)d, weight, dtype, out + row * (size_t)d, d, eps, 0, blockDim.x);
}

extern "C" __global__ void layer_norm(
    const float* __restrict__ x,
    const void* __restrict__ weight,
    float* __restrict__ out,
    int d,
    float eps,
    int dtype) {
    const size_t row = blockIdx.x;
    moec_norm_row(x + row * (size_t)d, weight, dtype, out + row * (size_t)d, d, eps, 1, blockDim.x);
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
    // In place: every thread has read its values before any writes (the reduction's
    // barriers), and each rewrites only the values it read.
    moec_norm_row(part, weight, 2, part, chunk, eps, 0, blockDim.x);
}
