// CPU emulation of the few CUDA builtins moec's kernels use, to check their math without a
// GPU: every CUDA thread of a block is a fiber (ucontext) on the calling OS thread, blocks
// run one after another (so `__shared__` statics are per block), __syncthreads is a block
// barrier, warp shuffles go through an exchange array with per-warp barriers. A thread that
// returns stops counting for the barriers (as on GPUs since Volta); a block whose live
// threads all wait on barriers that can never open aborts with a message. It checks
// indexing and arithmetic, not the GPU memory model, warp divergence or performance. The
// stand-in CUDA driver (standin/) compiles each kernel file after this header and runs
// launches through launch_grid; kernels/cpu_emulation/harness.cpp through launch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <ucontext.h>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
// Set by the scheduler before it resumes a fiber, so each fiber sees its own values.
dim3 threadIdx, blockIdx;
// The thread's linear index within its block (warps are runs of 32 of it, as on a GPU).
unsigned moec_tid;
const int warpSize = 32;
dim3 blockDim, gridDim;
float shfl_buf[1024];
float dyn_smem[65536];
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

struct MoecFiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    bool done = false;
    bool blocked = false;
};
// A barrier over `expected` live fibers; the last to arrive releases the others.
struct MoecBarrier {
    unsigned expected = 0;
    unsigned arrived = 0;
    std::vector<MoecFiber*> waiting;
    void release() {
        arrived = 0;
        for (MoecFiber* f : waiting) f->blocked = false;
        waiting.clear();
    }
};
constexpr size_t moec_stack_bytes = 256 * 1024;
ucontext_t moec_scheduler;
MoecFiber* moec_current = nullptr;
std::vector<MoecFiber> moec_fibers;
MoecBarrier moec_block_barrier;
std::vector<MoecBarrier> moec_warp_barriers;
const std::function<void()>* moec_body = nullptr;

inline void moec_arrive(MoecBarrier& b) {
    if (++b.arrived >= b.expected) {
        b.release();
        return;
    }
    MoecFiber* self = moec_current;
    self->blocked = true;
    b.waiting.push_back(self);
    swapcontext(&self->context, &moec_scheduler);
}
// A thread that returned no longer counts: barriers it would have completed open.
inline void moec_leave(MoecBarrier& b) {
    if (b.expected > 0) --b.expected;
    if (b.arrived > 0 && b.arrived >= b.expected) b.release();
}
inline void __syncthreads() { moec_arrive(moec_block_barrier); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    MoecBarrier& b = moec_warp_barriers[moec_tid / 32];
    shfl_buf[moec_tid] = v;
    moec_arrive(b);
    float r = shfl_buf[moec_tid ^ off];
    moec_arrive(b);
    return r;
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
#include <math.h>

inline void moec_fiber_main() {
    (*moec_body)();
    moec_current->done = true;
    moec_leave(moec_block_barrier);
    moec_leave(moec_warp_barriers[moec_tid / 32]);
    // Returning resumes the scheduler (uc_link).
}

// Runs a whole grid (3-D grid and block): for each block in turn, one fiber per thread,
// resumed round-robin until all returned.
inline void launch_grid_fn(dim3 grid, dim3 block, const std::function<void()>& f) {
    gridDim = grid; blockDim = block;
    moec_body = &f;
    const unsigned n = block.x * block.y * block.z;
    const unsigned n_warps = (n + 31) / 32;
    if (moec_fibers.size() < n) moec_fibers.resize(n);
    moec_warp_barriers.assign(n_warps, MoecBarrier{});
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        moec_block_barrier = MoecBarrier{};
        moec_block_barrier.expected = n;
        for (unsigned w = 0; w < n_warps; ++w) moec_warp_barriers[w] = MoecBarrier{std::min(32u, n - w * 32), 0, {}};
        for (unsigned t = 0; t < n; ++t) {
            MoecFiber& fiber = moec_fibers[t];
            if (!fiber.stack) fiber.stack.reset(new char[moec_stack_bytes]);
            fiber.done = false;
            fiber.blocked = false;
            getcontext(&fiber.context);
            fiber.context.uc_stack.ss_sp = fiber.stack.get();
            fiber.context.uc_stack.ss_size = moec_stack_bytes;
            fiber.context.uc_link = &moec_scheduler;
            makecontext(&fiber.context, moec_fiber_main, 0);
        }
        unsigned remaining = n;
        while (remaining > 0) {
            bool progressed = false;
            for (unsigned t = 0; t < n; ++t) {
                MoecFiber& fiber = moec_fibers[t];
                if (fiber.done || fiber.blocked) continue;
                threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                moec_tid = t;
                moec_current = &fiber;
                swapcontext(&moec_scheduler, &fiber.context);
                progressed = true;
                if (fiber.done) --remaining;
            }
            if (!progressed && remaining > 0) {
                std::fprintf(stderr, "moec-standin: kernel deadlock: in block (%u, %u, %u) every live thread waits at a barrier that cannot open\n", bx, by, bz);
                std::abort();
            }
        }
    }
    moec_body = nullptr;
}
template <class F> void launch_grid(dim3 grid, dim3 block, F f) {
    const std::function<void()> body = f;
    launch_grid_fn(grid, block, body);
}
template <class F> void launch(dim3 grid, dim3 block, F f) { launch_grid(grid, block, f); }
