// Block-quantised weights (ggml's Q8_0, Q4_K, Q5_K, Q6_K; dtype codes 3-6 of the prelude)
// outside the few-row products, which decode them inside the product themselves
// (linear_gemv.cu's linear_gemv, moe_grouped.cu's moe_grouped_gemv and moe_grouped_linear):
//   dequant_f32    a quantised matrix decoded to f32 ([out, in], as the CPU's f32 decode),
//                  for StreamCx::linear's many-row path: one cublasSgemm on the decoded
//                  copy, so a prefill's product is the CPU's f32-decoded product up to
//                  summation order
//   embed_quant    embed: out[t] = decode(table row ids[t]), as embed_bf16 for blocks
//
// Layouts: quantised tensors are rows of whole blocks ([out, in] / [vocab, hidden]), so
// element i is found from i alone (prelude's moec_quant_load). `n_groups` counts runs of 8
// weights (every block format holds a multiple of 8).
// Launch: dequant_f32: any 1-D grid, grid-stride loop over the runs. embed_quant: grid =
// (tokens), block = (threads) striding over the row in runs of 8 (hidden % 8 == 0: rows
// are whole blocks).

extern "C" __global__ void dequant_f32(
    const unsigned char* __restrict__ w,
    float* __restrict__ dst,
    long long n_groups,
    int dtype) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n_groups; g += stride) {
        float v[8];
        moec_quant_load(w, 8 * g, dtype, 8, v);
        for (int i = 0; i < 8; ++i) {
            dst[8 * g + i] = v[i];
        }
    }
}

extern "C" __global__ void embed_quant(
    const unsigned char* __restrict__ table,
    const unsigned int* __restrict__ ids,
    float* __restrict__ out,
    int hidden,
    int dtype) {
    const long long token = blockIdx.x;
    const long long row = (long long)ids[token] * hidden;
    for (int i = 8 * threadIdx.x; i < hidden; i += 8 * blockDim.x) {
        float v[8];
        moec_quant_load(table, row + i, dtype, 8, v);
        for (int j = 0; j < 8; ++j) {
            out[token * hidden + i + j] = v[j];
        }
    }
}
