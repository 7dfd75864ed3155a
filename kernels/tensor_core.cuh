// Tensor-core tiles for the kernels that multiply bf16 operands with f32 accumulation
// (moe_grouped_mma, prefill_attention's paged_prefill_attention_mma): 16x16x16 products
// through PTX's `wmma` instructions (sm_80 and newer for bf16), wrapped in a few functions:
//
//   MoecMmaAB             one 16x16 bf16 operand tile (the A or B side of a product)
//   MoecMmaAcc            one 16x16 f32 accumulator tile
//   moec_mma_load_a       A from row-major bf16 bits: element (m, k) at p[m * ld + k]
//   moec_mma_load_b       B from column-major bf16 bits: element (k, n) at p[n * ld + k]
//                         (a weight matrix stored [out, in] is B of x . W^T as it lies)
//   moec_mma_load_c       acc from row-major f32: element (m, n) at p[m * ld + n]
//   moec_mma_zero         acc = 0
//   moec_mma              acc += A . B (f32 accumulation)
//   moec_mma_store        acc to row-major f32: element (m, n) at p[m * ld + n]
//
// Every lane of a warp calls each with the same arguments (warp-collective, as wmma is).
// Pointers are 32-byte aligned and `ld` a multiple of 8 elements (wmma's rules); loads and
// stores use generic addresses (shared or global memory). Which element a lane holds is
// unspecified by PTX, so kernels touch fragments only through these functions and read
// results back from a stored tile.
//
// NVRTC ships no <mma.h> (nvcuda::wmma is a toolkit header: `#include <mma.h>` fails with
// "could not open source file"), so the instructions are written as inline PTX here. The
// CPU emulation (kernels/cpu_emulation/shim.h) defines the same names with every lane
// holding the whole tile, since no element-to-lane mapping is specified to copy.

// f32 to bf16 bits, rounded to nearest even (NaN kept quiet): ops.cu's narrow_bf16, and
// the CPU's half::bf16::from_f32.
__device__ __forceinline__ unsigned short moec_f32_to_bf16(float value) {
    const unsigned int x = __float_as_uint(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x40u);
    }
    if ((x & 0x8000u) != 0 && (x & 0x17fffu) != 0) {
        return (unsigned short)((x >> 16) + 1);
    }
    return (unsigned short)(x >> 16);
}

// x as a bf16 pair, hi = bf16(x), lo = bf16(x - hi): hi + lo carries 16 of x's 24
// significant bits (relative error <= 2^-17), so a product of the pair with bf16 weights
// and f32 accumulation agrees with the CPU's f32-activation product to ~1e-5 relative, not
// bf16's 4e-3 (ops.cu's split_bf16, the cuBLAS path's pair).
__device__ __forceinline__ void moec_split_bf16(float x, unsigned short* hi, unsigned short* lo) {
    const unsigned short h = moec_f32_to_bf16(x);
    *hi = h;
    *lo = moec_f32_to_bf16(x - moec_bf16_to_f32(h));
}

#ifdef __CUDACC_RTC__
struct MoecMmaAB {
    unsigned int r[4];
};
struct MoecMmaAcc {
    float r[8];
};

__device__ __forceinline__ void moec_mma_load_a(MoecMmaAB& a, const unsigned short* p, int ld) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3])
                 : "l"(p), "r"(ld)
                 : "memory");
}

__device__ __forceinline__ void moec_mma_load_b(MoecMmaAB& b, const unsigned short* p, int ld) {
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(b.r[0]), "=r"(b.r[1]), "=r"(b.r[2]), "=r"(b.r[3])
                 : "l"(p), "r"(ld)
                 : "memory");
}

__device__ __forceinline__ void moec_mma_load_c(MoecMmaAcc& c, const float* p, int ld) {
    asm volatile(
        "wmma.load.c.sync.aligned.row.m16n16k16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, [%8], %9;"
        : "=f"(c.r[0]), "=f"(c.r[1]), "=f"(c.r[2]), "=f"(c.r[3]), "=f"(c.r[4]), "=f"(c.r[5]),
          "=f"(c.r[6]), "=f"(c.r[7])
        : "l"(p), "r"(ld)
        : "memory");
}

__device__ __forceinline__ void moec_mma_zero(MoecMmaAcc& c) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        c.r[i] = 0.0f;
    }
}

__device__ __forceinline__ void moec_mma(MoecMmaAcc& c, const MoecMmaAB& a, const MoecMmaAB& b) {
    asm volatile(
        "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, {%12, %13, %14, %15}, "
        "{%0, %1, %2, %3, %4, %5, %6, %7};"
        : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3]), "+f"(c.r[4]), "+f"(c.r[5]),
          "+f"(c.r[6]), "+f"(c.r[7])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]),
          "r"(b.r[2]), "r"(b.r[3]));
}

__device__ __forceinline__ void moec_mma_store(float* p, const MoecMmaAcc& c, int ld) {
    asm volatile(
        "wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8}, %9;"
        :
        : "l"(p), "f"(c.r[0]), "f"(c.r[1]), "f"(c.r[2]), "f"(c.r[3]), "f"(c.r[4]), "f"(c.r[5]),
          "f"(c.r[6]), "f"(c.r[7]), "r"(ld)
        : "memory");
}
#endif
