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

/* q8_packed_512.h's integer dot on vpdpbusd. */
struct VnniAcc512 {
    static __m512i q4_1(const __m512i *lo, const __m512i *hi, const int8_t *q) {
        __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            low = _mm512_dpbusd_epi32(low, lo[t], _mm512_set1_epi32(four_bytes(q + 4 * t)));
            high = _mm512_dpbusd_epi32(high, hi[t], _mm512_set1_epi32(four_bytes(q + 16 + 4 * t)));
        }
        return _mm512_add_epi32(low, high);
    }
    /* 128 times each row's weight sum over the block */
    struct Q8Prep {
        __m512i shift;
        explicit Q8Prep(const Q8Chunks &c) {
            const __m512i ones = _mm512_set1_epi8(1);
            __m512i sum = _mm512_setzero_si512();
            for (int t = 0; t < 8; t++) sum = _mm512_dpbusd_epi32(sum, ones, c.w[t]);
            shift = _mm512_slli_epi32(sum, 7);
        }
    };
    static __m512i q8_0(const Q8Chunks &c, const Q8Prep &p, const int8_t *q) {
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int t = 0; t < 8; t += 2) {
            const int32_t flip = static_cast<int32_t>(0x80808080u);
            even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(four_bytes(q + 4 * t) ^ flip), c.w[t]);
            odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(four_bytes(q + 4 * t + 4) ^ flip), c.w[t + 1]);
        }
        return _mm512_sub_epi32(_mm512_add_epi32(even, odd), p.shift);
    }
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
