// The integer products' per-format pieces, shared by q8_products.cu and q8_products_rows.cu:
// moec_dp4a (__dp4a, or its byte products under the CPU emulation), moec_load_u32_a2 (four
// bytes at a 2-byte aligned address) and MoeQ8<DT> (units per block, block bytes and
// weights per block of formats 3 Q8_0, 4 Q4_K, 5 Q5_K, 6 Q6_K). What a unit is: see
// q8_products.cu's header comment.

#ifdef __CUDACC_RTC__
__device__ __forceinline__ int moec_dp4a(unsigned int a, unsigned int b, int c) {
    return __dp4a((int)a, (int)b, c);
}
#else
// The CPU emulation (kernels/cpu_emulation) has no __dp4a: the same signed byte products.
inline int moec_dp4a(unsigned int a, unsigned int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    }
    return c;
}
#endif

// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ unsigned int moec_load_u32_a2(const unsigned char* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (unsigned int)h[0] | ((unsigned int)h[1] << 16);
}

// Units per block and block bytes of each integer-product format.
template <int DT> struct MoeQ8 {};
template <> struct MoeQ8<3> { static const int UNITS = 4; static const int BYTES = 34; static const int ELEMS = 32; };
template <> struct MoeQ8<4> { static const int UNITS = 8; static const int BYTES = 144; static const int ELEMS = 256; };
template <> struct MoeQ8<5> { static const int UNITS = 8; static const int BYTES = 176; static const int ELEMS = 256; };
template <> struct MoeQ8<6> { static const int UNITS = 16; static const int BYTES = 210; static const int ELEMS = 256; };
