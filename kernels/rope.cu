// Rotary position embeddings in the NeoX ("rotate_half") layout, as
// src/math/rope.rs and projection.rs apply them: within each head of width
// head_dim = 2 * half, element i pairs with element i + half:
//   lo' = lo * cos - hi * sin,   hi' = hi * cos + lo * sin.
//
// Layout: qkv is [n_tokens, row_width] f32 rows laid out [q heads | k heads | v heads]
// (row_width = (heads + 2 * kv_heads) * head_dim); the first n_rot_heads = heads + kv_heads
// heads of each row (q and k) are rotated in place, v is left alone. positions is
// [n_tokens] int. cos_table and sin_table are [max_positions, half] f32, built on the host
// exactly as RopeTable::new builds them (inv_freq = 1 / theta^(2i/d) in f32, angle =
// position * inv_freq in f32), so the tables are bit-identical to the CPU's; the caller
// keeps every position below max_positions (the CPU kernel reports it as an error).
// NVRTC may contract a * c - b * s into one fused multiply-add, so rotated values agree
// with the CPU to rounding.
// Launch: grid = (n_tokens, n_rot_heads), block = (threads); threads stride over half.

extern "C" __global__ void rope_neox(
    float* __restrict__ qkv,
    const int* __restrict__ positions,
    const float* __restrict__ cos_table,
    const float* __restrict__ sin_table,
    int row_width,
    int n_rot_heads,
    int head_dim) {
    const size_t token = blockIdx.x;
    const int head = blockIdx.y;
    if (head >= n_rot_heads) {
        return;
    }
    const int half = head_dim / 2;
    float* lo = qkv + token * (size_t)row_width + (size_t)head * head_dim;
    float* hi = lo + half;
    const size_t table_row = (size_t)positions[token] * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = cos_table[table_row + i];
        const float s = sin_table[table_row + i];
        const float a = lo[i];
        const float b = hi[i];
        lo[i] = a * c - b * s;
        hi[i] = b * c + a * s;
    }
}
