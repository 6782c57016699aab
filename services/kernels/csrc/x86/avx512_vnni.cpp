/* The AVX-512 variant's 8-bit products on VNNI (vpdpbusd: four u8 x s8 products summed
 * into each int32 lane in one instruction), 512 bits wide (q8_products_512.h); the rest
 * of the avx512vnni variant is avx512.cpp's. Its own file, built for VNNI, so that
 * nothing else in the AVX-512 variant needs it. */
#if defined(__x86_64__) && !defined(OMNI_GENERIC_KERNELS)
#include <immintrin.h>

#include "../kernels.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

#include "q8_packed.h"
#include "q8_packed_512.h"
#include "q8_products.h"
#include "q8_products_512.h"

namespace omni {
namespace {

struct VnniDot {
    static __m256i unsigned_signed(__m256i u, __m256i s) {
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
    }
};

struct VnniAcc512 {
    static __m512i step(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
    static __m512i finish(__m512i acc) { return acc; }
};

struct VnniDot512 {
    static __m512i unsigned_signed(__m512i u, __m512i s) {
        return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
    }
};

}  // namespace

void avx512vnni_product_q8(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                           int64_t n1, float *y) {
    q8_product512<VnniDot512, VnniDot>(w, x, rows, n0, n1, y);
}

void avx512vnni_product_packed(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                               int64_t n1, float *y) {
    packed_product512<VnniAcc512>(w, x, rows, n0, n1, y);
}

}  // namespace omni
#endif
