// The pieces of the newer MoE families that Mixtral and DBRX do not have, with the CPU
// backend's math (src/math/projection.rs, moe.rs):
//   (the q/k RMSNorm of Qwen3 and OLMoE, qk_rms_norm_f32, is in rms_norm.cu beside the
//   other norms and shares their block reduction)
//   bias_rows           x[r, col + i] (+)= b[i] for i < cols: q/k/v, o_proj, router and
//                       expert biases (accumulate = 1), gpt-oss's sinks copied into each qkv
//                       row (accumulate = 0)
//   sigmoid_scale_rows  Qwen2-MoE's shared-expert gate: x[r, :] *= 1 / (1 + exp(-g[r]))
//   clamped_swiglu      gpt-oss's expert activation over interleaved gate/up (biases
//                       already added): g = min(gu[2i], limit), u = clamp(gu[2i+1], -limit,
//                       limit), out[i] = (u + 1) * g * sigmoid(alpha * g); `live` (0:
//                       none) a device count of the rows that hold values (grouped expert
//                       positions): rows past it are neither read nor written
//
// Layout: activations are f32 rows, row-major; `ld` is a row's stride in floats (a qkv row
// is wider than the part a kernel touches). Weights and biases are f32 (the caller widens
// stored bf16/f16 vectors first with widen_bf16/widen_f16).
// Launch: bias_rows, sigmoid_scale_rows and clamped_swiglu: grid = (n_rows), block = (threads)
// striding over the row. Sums are reduced as a tree, so norms agree with the CPU to
// rounding, not bit for bit.

extern "C" __global__ void bias_rows(
    float* __restrict__ x,
    const float* __restrict__ bias,
    int ld,
    int col,
    int cols,
    int accumulate) {
    float* row = x + (size_t)blockIdx.x * ld + col;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        row[i] = accumulate ? row[i] + bias[i] : bias[i];
    }
}

extern "C" __global__ void sigmoid_scale_rows(float* __restrict__ x, const float* __restrict__ logits, int width) {
    const size_t row = blockIdx.x;
    const float s = 1.0f / (1.0f + expf(-logits[row]));
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        x[row * width + i] *= s;
    }
}

extern "C" __global__ void clamped_swiglu(
    const float* __restrict__ gate_up,
    float* __restrict__ out,
    int ffn,
    float alpha,
    float limit,
    const int* __restrict__ live) {
    const size_t row = blockIdx.x;
    if (live != 0 && row >= (size_t)*live) {
        return;
    }
    const float* gu = gate_up + row * 2 * (size_t)ffn;
    for (int i = threadIdx.x; i < ffn; i += blockDim.x) {
        const float g0 = gu[2 * i];
        const float u0 = gu[2 * i + 1];
        // As on the CPU: f32::min gives `limit` for a NaN gate, f32::clamp keeps a NaN up.
        const float g = (g0 > limit || g0 != g0) ? limit : g0;
        const float u = u0 < -limit ? -limit : (u0 > limit ? limit : u0);
        const float glu = g * (1.0f / (1.0f + expf(-(g * alpha))));
        out[row * ffn + i] = (u + 1.0f) * glu;
    }
}
