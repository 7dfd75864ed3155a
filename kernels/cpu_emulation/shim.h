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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#include <ucontext.h>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
// CUDA's 16-byte vector types (NVRTC has them built in), for the kernels' vector loads.
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
// Set by the scheduler before it resumes a fiber, so each fiber sees its own values.
dim3 threadIdx, blockIdx;
// The thread's linear index within its block (warps are runs of 32 of it, as on a GPU).
unsigned moec_tid;
const int warpSize = 32;
dim3 blockDim, gridDim;
float shfl_buf[2 * 1024];
float dyn_smem[65536];
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

// A CUDA thread: its saved context, its own stack and its indices. The fields the
// scheduler reads on every switch come first and the struct is small (ucontext_t, over
// 900 bytes, exists only where there is no hand-written switch), so a block's fibers
// share few cache lines.
struct MoecFiber {
    void* sp = nullptr;  // saved stack pointer (x86-64 switch)
    dim3 idx;            // threadIdx
    unsigned tid = 0;    // linear index within the block
    bool done = false;
    bool blocked = false;
    // Which half of the shuffle exchange the thread's next shuffle uses (see moec_shfl).
    unsigned char shfl_half = 0;
    std::unique_ptr<char[]> stack;
#if !defined(__x86_64__)
    ucontext_t context;
#endif
};
// Fibers ready to run, first in first out: a ring of at most one entry per fiber (a
// fiber is queued only when it starts or when a barrier releases it).
struct MoecRunQueue {
    std::vector<MoecFiber*> ring;
    size_t head = 0, len = 0;
    void reset(size_t n) {
        if (ring.size() < n) ring.resize(n);
        head = 0;
        len = 0;
    }
    void push(MoecFiber* f) { ring[(head + len++) % ring.size()] = f; }
    MoecFiber* pop() {
        if (len == 0) return nullptr;
        MoecFiber* f = ring[head];
        head = (head + 1) % ring.size();
        --len;
        return f;
    }
};
MoecRunQueue moec_ready;
// A barrier over `expected` live fibers; the last to arrive releases the others, which
// queue in arrival order.
struct MoecBarrier {
    unsigned expected = 0;
    unsigned arrived = 0;
    std::vector<MoecFiber*> waiting;
    void reset(unsigned n) {
        expected = n;
        arrived = 0;
        waiting.clear();
    }
    void release() {
        arrived = 0;
        for (MoecFiber* f : waiting) {
            f->blocked = false;
            moec_ready.push(f);
        }
        waiting.clear();
    }
};
constexpr size_t moec_stack_bytes = 256 * 1024;
// The launching thread's context while fibers run (the scheduler).
MoecFiber moec_scheduler;
MoecFiber* moec_current = nullptr;
std::vector<MoecFiber> moec_fibers;
MoecBarrier moec_block_barrier;
std::vector<MoecBarrier> moec_warp_barriers;
const std::function<void()>* moec_body = nullptr;
inline void moec_fiber_main();

#if defined(__x86_64__)
// A context switch without ucontext's signal-mask system call (most of a launch's time):
// saves the callee-saved registers on the current stack, stores the stack pointer in
// *from and resumes the stack `to`. MXCSR and the x87 control word are not switched:
// every fiber starts with the launching thread's (moec_prepare) and no kernel changes
// them (CUDA C has no rounding-mode or exception-mask call), so they are the same on
// every stack; saving and reloading them (ldmxcsr and fldcw drain the pipeline) was 85%
// of the switch's time and a quarter of a stand-in run's.
extern "C" void moec_switch(void** from, void* to);
asm(R"(
    .text
    .weak moec_switch
    .hidden moec_switch
    .type moec_switch, @function
moec_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size moec_switch, .-moec_switch
)");
extern "C" inline void moec_fiber_entry() {
    moec_fiber_main();  // never returns: it switches away for good
    std::abort();
}
// Lays out a fresh stack so that the first switch to it "returns" into moec_fiber_entry
// with the ABI's alignment; the fiber runs under the launching thread's floating-point
// control state (MXCSR, x87 control word), which no switch changes.
inline void moec_prepare(MoecFiber& fiber, size_t bytes) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(fiber.stack.get()) + bytes) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;                                                   // fake return address
    *--sp = reinterpret_cast<uint64_t>(&moec_fiber_entry);       // ret target (16-aligned)
    for (int i = 0; i < 6; ++i) *--sp = 0;                       // rbp rbx r12-r15
    fiber.sp = sp;
}
#endif

// Leaves `from` (its context saved) for `to`, which becomes the current fiber with its
// indices; a direct switch between two CUDA threads, never through the scheduler.
inline void moec_jump(MoecFiber* from, MoecFiber* to) {
    moec_current = to;
    threadIdx = to->idx;
    moec_tid = to->tid;
#if defined(__x86_64__)
    moec_switch(&from->sp, to->sp);
#else
    swapcontext(&from->context, &to->context);
#endif
}
// The current fiber stops running (blocked at a barrier, or done): the next ready fiber
// runs, or the scheduler when none is (the block is over, or deadlocked).
inline void moec_yield() {
    MoecFiber* next = moec_ready.pop();
    moec_jump(moec_current, next != nullptr ? next : &moec_scheduler);
}
inline void moec_arrive(MoecBarrier& b) {
    if (++b.arrived >= b.expected) {
        b.release();
        return;
    }
    moec_current->blocked = true;
    b.waiting.push_back(moec_current);
    moec_yield();
}
// A thread that returned no longer counts: barriers it would have completed open.
inline void moec_leave(MoecBarrier& b) {
    if (b.expected > 0) --b.expected;
    if (b.arrived > 0 && b.arrived >= b.expected) b.release();
}
inline void __syncthreads() { moec_arrive(moec_block_barrier); }
// Warp shuffles exchange through shfl_buf, in two halves used alternately: a lane writes
// its value into the half of this shuffle, waits for the warp, and reads. One barrier per
// shuffle is enough: a lane writes this half again only two shuffles later, after the
// next shuffle's barrier, which every lane reaches only once it has read this one.
template <class T> inline T moec_shfl_at(T v, unsigned (*src)(unsigned, int), int arg) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    MoecFiber* self = moec_current;
    float* half = shfl_buf + 1024 * self->shfl_half;
    self->shfl_half ^= 1;
    std::memcpy(&half[moec_tid], &v, 4);
    moec_arrive(moec_warp_barriers[moec_tid / 32]);
    T r;
    std::memcpy(&r, &half[src(moec_tid, arg)], 4);
    return r;
}
inline unsigned moec_lane_xor(unsigned tid, int off) { return tid ^ (unsigned)off; }
inline unsigned moec_lane_of(unsigned tid, int src) { return (tid & ~31u) + (unsigned)(src & 31); }
inline float __shfl_xor_sync(unsigned, float v, int off) { return moec_shfl_at(v, moec_lane_xor, off); }
// Lane `src` of the warp's value (a broadcast), for floats and ints.
template <class T> inline T moec_shfl(T v, int src) { return moec_shfl_at(v, moec_lane_of, src); }
inline float __shfl_sync(unsigned, float v, int src) { return moec_shfl(v, src); }
inline int __shfl_sync(unsigned, int v, int src) { return moec_shfl(v, src); }
// CUDA's integer min and max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
// Rounded f32 multiply, subtract and add that are never contracted into a fused multiply-add.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
#include <math.h>
#define __align__(n) __attribute__((aligned(n)))

// Tensor-core tiles (kernels/tensor_core.cuh's moec_mma_*, inline PTX `wmma` on a GPU).
// PTX leaves unspecified which elements of a 16x16 tile each lane of the warp holds, so
// there is no mapping to copy: here every lane holds the whole tile (element (row, col)
// at v[16 * row + col]; A as (m, k), B as (k, n), the accumulator as (m, n)) and does the
// warp's product itself, redundantly. What a kernel can observe is the same: a fragment
// is filled by a load, changed by zero/mma and read back only through a store, all
// warp-collective (every lane stores the same values; each load and store waits for the
// whole warp, as the instructions do). The products are exact (bf16 x
// bf16 fits f32) and summed in f32 in k order. The loads check wmma's rules (32-byte
// aligned pointer, ld a multiple of 8 elements), which a GPU would fault on or misread.
struct MoecMmaAB { float v[256]; };
struct MoecMmaAcc { float v[256]; };
inline float moec_emul_bf16(unsigned short bits) {
    const unsigned int u = (unsigned int)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// wmma loads and stores are warp-synchronous: every lane of the warp reaches the
// instruction before any lane's access is done. Fibers run one at a time until a barrier,
// so each load and store first waits for the whole warp there; otherwise a lane would
// store a tile (moec_mma_store) before a slower lane loaded the old one (moec_mma_load_c
// of the same tile: a read-modify-write of an accumulator kept in shared memory).
inline void moec_mma_check(const void* p, int ld, const char* what) {
    moec_arrive(moec_warp_barriers[moec_tid / 32]);
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || ld % 8 != 0) {
        std::fprintf(stderr, "moec-standin: %s of a tensor-core tile at %p with ld %d: wmma needs a 32-byte aligned pointer and ld a multiple of 8\n", what, p, ld);
        std::abort();
    }
}
inline void moec_mma_load_a(MoecMmaAB& a, const unsigned short* p, int ld) {
    moec_mma_check(p, ld, "load_a");
    for (int m = 0; m < 16; ++m)
        for (int k = 0; k < 16; ++k) a.v[16 * m + k] = moec_emul_bf16(p[m * ld + k]);
}
inline void moec_mma_load_b(MoecMmaAB& b, const unsigned short* p, int ld) {
    moec_mma_check(p, ld, "load_b");
    for (int n = 0; n < 16; ++n)
        for (int k = 0; k < 16; ++k) b.v[16 * k + n] = moec_emul_bf16(p[n * ld + k]);
}
inline void moec_mma_load_c(MoecMmaAcc& c, const float* p, int ld) {
    moec_mma_check(p, ld, "load_c");
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) c.v[16 * m + n] = p[m * ld + n];
}
inline void moec_mma_zero(MoecMmaAcc& c) {
    for (float& v : c.v) v = 0.0f;
}
inline void moec_mma(MoecMmaAcc& c, const MoecMmaAB& a, const MoecMmaAB& b) {
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            float s = c.v[16 * m + n];
            for (int k = 0; k < 16; ++k) s += a.v[16 * m + k] * b.v[16 * k + n];
            c.v[16 * m + n] = s;
        }
}
inline void moec_mma_store(float* p, const MoecMmaAcc& c, int ld) {
    moec_mma_check(p, ld, "store");
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) p[m * ld + n] = c.v[16 * m + n];
}

// Bytes fiber `t` leaves unused at the top of its stack: a distinct 64-byte line for each
// of 256 fibers (16 KiB), so consecutive fibers' frames fall in different cache sets.
inline size_t moec_stack_stagger(unsigned t) { return size_t(t % 256) * 64; }

inline void moec_fiber_main() {
    (*moec_body)();
    moec_current->done = true;
    moec_leave(moec_block_barrier);
    moec_leave(moec_warp_barriers[moec_tid / 32]);
    moec_yield();  // never resumed
}

// Runs a whole grid (3-D grid and block): for each block in turn, one fiber per thread,
// started in thread order; a fiber runs until it returns or waits at a barrier, and then
// the next ready fiber runs (released fibers queue in arrival order). The scheduler gets
// control back only when no fiber is ready: the block is done, or it is deadlocked.
inline void launch_grid_fn(dim3 grid, dim3 block, const std::function<void()>& f) {
    gridDim = grid; blockDim = block;
    moec_body = &f;
    const unsigned n = block.x * block.y * block.z;
    const unsigned n_warps = (n + 31) / 32;
    if (moec_fibers.size() < n) moec_fibers.resize(n);
    moec_warp_barriers.resize(n_warps);
#if !defined(__x86_64__)
    // One getcontext (a system call) per launch; each fiber starts from a copy of it.
    ucontext_t blank;
    getcontext(&blank);
#endif
    for (unsigned t = 0; t < n; ++t) {
        MoecFiber& fiber = moec_fibers[t];
        if (!fiber.stack) fiber.stack.reset(new char[moec_stack_bytes]);
        fiber.idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        fiber.tid = t;
    }
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        moec_block_barrier.reset(n);
        for (unsigned w = 0; w < n_warps; ++w) moec_warp_barriers[w].reset(std::min(32u, n - w * 32));
        moec_ready.reset(n);
        for (unsigned t = 0; t < n; ++t) {
            MoecFiber& fiber = moec_fibers[t];
            fiber.done = false;
            fiber.blocked = false;
            fiber.shfl_half = 0;
#if defined(__x86_64__)
            // Each stack is its own 256 KiB allocation, so their tops share one offset
            // modulo every cache's set stride: without a per-fiber stagger every switch
            // evicted the previous fibers' frames from L1 and L2 (half of a stand-in
            // run's time was the switch itself).
            moec_prepare(fiber, moec_stack_bytes - moec_stack_stagger(t));
#else
            fiber.context = blank;
            fiber.context.uc_stack.ss_sp = fiber.stack.get();
            fiber.context.uc_stack.ss_size = moec_stack_bytes;
            fiber.context.uc_link = nullptr;
            makecontext(&fiber.context, moec_fiber_main, 0);
#endif
            moec_ready.push(&fiber);
        }
        moec_current = &moec_scheduler;
        moec_yield();
        for (unsigned t = 0; t < n; ++t) {
            if (!moec_fibers[t].done) {
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
