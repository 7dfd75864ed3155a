// The tile sizes and the grouped tiles' warp assignment and epilogue, shared by the grouped
// and few-row kernels (moe_grouped.cu's float products, linear_gemv.cu's, q8_products.cu's
// and q8_products_rows.cu's integer products):
//   MOE_TILE_M           the grouped positions of one expert a tile holds (moe_group's
//                        tiles), and the most activation rows a few-row product takes a pass
//   MOE_GEMV_WARPS       warps a block of the few-row kernels
//   moe_store            the grouped kernels' epilogues (store, SwiGLU, weighted scatter)
//   moe_warp_tile        a warp's (tile, output feature) of the few-row grouped kernels
// Include it before warp_dot.cuh (kernels::full_source inlines headers without nesting).

#define MOE_TILE_M 16
// Warps a block of the few-row kernels (moe_grouped_gemv and the linear_gemv family).
#define MOE_GEMV_WARPS 8

// The grouped kernels' epilogue at grouped position p and output o, given the product `v`
// (its bias added) and, in mode 3, the up product `up`:
//   0: y[p, o] = v
//   1: y[p, o] = silu(y[p, o]) * v                      (y holds the gate product)
//   2: slots[row(p), slot(p), o] = weight(p) * v        (scatter_weighted's)
//   3: y[p, o] = silu(v) * up                           (gate, up and SwiGLU in one launch)
// with swiglu.cu's formula.
__device__ __forceinline__ void moe_store(float* y, long long p, int o, int out_dim, int mode,
                                          float v, float up, const unsigned int* perm_row,
                                          const unsigned int* perm_slot,
                                          const float* perm_weight, int top_k) {
    if (mode == 3) {
        y[p * out_dim + o] = v / (1.0f + expf(-v)) * up;
    } else if (mode == 0) {
        y[p * out_dim + o] = v;
    } else if (mode == 1) {
        const float g = y[p * out_dim + o];
        y[p * out_dim + o] = g / (1.0f + expf(-g)) * v;
    } else {
        const long long to = ((long long)perm_row[p] * top_k + perm_slot[p]) * out_dim + o;
        y[to] = perm_weight[p] * v;
    }
}

// What a warp of the few-row grouped kernels (a warp per (tile, output feature), grid (max
// tiles, ceil(out / MOE_GEMV_WARPS))) works on: its tile's expert, first position and rows,
// its output and lane. False when the block's tile is past the tile count or the warp's
// output past out_dim: the caller returns.
struct MoeWarpTile {
    int expert;
    int first;
    int rows;
    int o;
    int lane;
};

__device__ __forceinline__ bool moe_warp_tile(const int* tiles, int out_dim, MoeWarpTile& t) {
    const int tile = blockIdx.x;
    if (tile >= tiles[0]) {
        return false;
    }
    t.lane = threadIdx.x & 31;
    t.o = blockIdx.y * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (t.o >= out_dim) {
        return false;
    }
    t.expert = tiles[2 + 3 * tile];
    t.first = tiles[2 + 3 * tile + 1];
    t.rows = tiles[2 + 3 * tile + 2];
    return true;
}
