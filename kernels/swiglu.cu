// The experts' SwiGLU activation, as expert_ffn in src/math/moe.rs computes it:
//   gate[i] = silu(gate[i]) * up[i],   silu(x) = x / (1 + exp(-x)).
//
// Layout: gate and up are the same n f32 elements ([n_rows, ffn] row-major, but only the
// element count matters); the result overwrites gate, ready for the down projection.
// Launch: any 1-D grid; threads stride over n.

extern "C" __global__ void swiglu(float* __restrict__ gate, const float* __restrict__ up, int n) {
    const int stride = blockDim.x * gridDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
