// CPU emulation of the few CUDA builtins moec's kernels use, to check their math without a
// GPU: one OS thread per CUDA thread, blocks run one after another (so `__shared__` statics
// are per block), __syncthreads is a block barrier, warp shuffles go through an exchange
// array with per-warp barriers. It checks indexing and arithmetic, not the GPU memory
// model, warp divergence or performance. The stand-in CUDA driver (standin/) compiles each
// kernel file after this header and runs launches through launch_grid.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <memory>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
// The thread's linear index within its block (warps are runs of 32 of it, as on a GPU).
thread_local unsigned moec_tid;
const int warpSize = 32;
dim3 blockDim, gridDim;
std::unique_ptr<std::barrier<>> block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float shfl_buf[1024];
float dyn_smem[65536];
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    auto& b = *warp_barriers[moec_tid / 32];
    shfl_buf[moec_tid] = v;
    b.arrive_and_wait();
    float r = shfl_buf[moec_tid ^ off];
    b.arrive_and_wait();
    return r;
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
#include <math.h>
template <class F> void launch(dim3 grid, dim3 block, F f) {
    gridDim = grid; blockDim = block;
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        block_barrier = std::make_unique<std::barrier<>>(block.x);
        warp_barriers.clear();
        for (unsigned w = 0; w < (block.x + 31) / 32; ++w)
            warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block.x; ++t)
            ts.emplace_back([=] { blockIdx = {bx, by, 0}; threadIdx = {t, 0, 0}; moec_tid = t; f(); });
        for (auto& t : ts) t.join();
    }
}
// Runs a whole grid (3-D grid and block) with one OS thread per thread of a block, reused
// for every block in turn; a block-wide barrier after each block keeps one block's
// __shared__ statics from being overwritten by the next while still in use. A warp shorter
// than 32 threads (the block's last) gets a barrier of its own size.
template <class F> void launch_grid(dim3 grid, dim3 block, F f) {
    gridDim = grid; blockDim = block;
    const unsigned n = block.x * block.y * block.z;
    block_barrier = std::make_unique<std::barrier<>>(n);
    warp_barriers.clear();
    for (unsigned w = 0; w < (n + 31) / 32; ++w)
        warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - w * 32)));
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < n; ++t)
        ts.emplace_back([=, &f] {
            moec_tid = t;
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned bz = 0; bz < grid.z; ++bz)
            for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = {bx, by, bz};
                f();
                block_barrier->arrive_and_wait();
            }
        });
    for (auto& t : ts) t.join();
}
