/* The AVX-512 variant (AVX-512 F, BW, VL with F16C and FMA).
 *
 * Products: two weight rows at a time, so each activation load feeds four FMAs (a
 * batched step is bound by float32 FMAs); over activation tiles of 8, 4, 2 or 1 rows
 * packed by pack_tiles, each width its own instantiation so that the accumulators
 * stay in registers. A Q4_1 block's 16 possible weights are computed once (d * i + m,
 * the same two roundings) and each weight is looked up by its nibble (vpermps): no
 * weight is converted from an integer. The exp of SiLU and of the softmax is Cephes'
 * expf polynomial (about 1 ulp). */
#if defined(__x86_64__) && !defined(OMNI_GENERIC_KERNELS)
#include <immintrin.h>

#include "../kernels.h"

namespace omni {
/* avx512_vnni.cpp */
void avx512vnni_product_q8(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                           int64_t n1, float *y);
void avx512vnni_product_packed(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                               int64_t n1, float *y);
namespace {
/* Before the pragma, as the includes are: the check itself, and whatever they define
 * inline, stay plain x86-64 (the linker keeps one copy of an inline function, and it
 * must not be one built for an instruction set the CPU may lack). */
bool supported() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma") && os_saves(XCR0_AVX512);
}
bool supported_vnni() { return supported() && __builtin_cpu_supports("avx512vnni"); }
}  // namespace
}  // namespace omni

#pragma GCC target("avx512f,avx512bw,avx512vl,f16c,fma")

#include "q8_packed.h"
#include "q8_packed_512.h"
#include "q8_products.h"
#include "q8_products_512.h"

namespace omni {
namespace {

struct Q4_1Blocks {
    const uint8_t *qs;
    const uint16_t *d, *m;
    __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    explicit Q4_1Blocks(const BlockWeight &w)
        : qs(static_cast<const uint8_t *>(w.qs)), d(w.d), m(w.m) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * (QK / 2)); }
    void operator()(int64_t block, __m512 &lo, __m512 &hi) const {
        const __m512i q = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + block * (QK / 2))));
        /* one FMA is gguf-py's two roundings: d * i is exact (an 11-bit half times
         * at most 4 bits) */
        const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(_cvtsh_ss(d[block])),
                                             _mm512_set1_ps(_cvtsh_ss(m[block])));
        lo = _mm512_permutexvar_ps(q, table);
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    }
};

struct Q8_0Blocks {
    const int8_t *qs;
    const uint16_t *d;
    explicit Q8_0Blocks(const BlockWeight &w) : qs(static_cast<const int8_t *>(w.qs)), d(w.d) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * QK); }
    void operator()(int64_t block, __m512 &lo, __m512 &hi) const {
        const int8_t *q = qs + block * QK;
        const __m512 scale = _mm512_set1_ps(_cvtsh_ss(d[block]));
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i *>(q)))),
                           scale);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i *>(q + 16)))),
                           scale);
    }
};

/* Output rows [n0, n1) for one tile of BT rows (xp packed, `real` of them not padding):
 * an odd last row is computed twice and stored once. */
template <int BT, class Blocks>
void tile(const Blocks &blocks, const float *xp, int64_t nb, int64_t n0, int64_t n1, float *y,
          int64_t n, int64_t real) {
    const int64_t ahead = PREFETCH_ROWS * nb;
    for (int64_t r = n0; r < n1; r += 2) {
        const int64_t r1 = r + 1 < n1 ? r + 1 : r;
        __m512 a0[BT], a1[BT];
        for (int b = 0; b < BT; b++) a0[b] = a1[b] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            __m512 w0lo, w0hi, w1lo, w1hi;
            if (r1 + PREFETCH_ROWS < n) {
                blocks.prefetch(r * nb + j + ahead);
                blocks.prefetch(r1 * nb + j + ahead);
            }
            blocks(r * nb + j, w0lo, w0hi);
            blocks(r1 * nb + j, w1lo, w1hi);
            const float *xj = xp + j * (BT * QK);
            for (int b = 0; b < BT; b++) {
                const __m512 xl = _mm512_loadu_ps(xj + b * QK);
                const __m512 xh = _mm512_loadu_ps(xj + b * QK + QK / 2);
                a0[b] = _mm512_fmadd_ps(w0lo, xl, a0[b]);
                a0[b] = _mm512_fmadd_ps(w0hi, xh, a0[b]);
                a1[b] = _mm512_fmadd_ps(w1lo, xl, a1[b]);
                a1[b] = _mm512_fmadd_ps(w1hi, xh, a1[b]);
            }
        }
        for (int b = 0; b < real; b++) {
            y[b * n + r] = _mm512_reduce_add_ps(a0[b]);
            if (r1 != r) y[b * n + r1] = _mm512_reduce_add_ps(a1[b]);
        }
    }
}

template <class Blocks>
void rows_of(const Blocks &blocks, const BlockWeight &w, const float *xp, int64_t rows,
             int64_t n0, int64_t n1, float *y) {
    const int64_t nb = w.k / QK;
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        const float *xt = xp + b0 * w.k;
        float *yt = y + b0 * w.n;
        switch (bt) {
        case 8: tile<8>(blocks, xt, nb, n0, n1, yt, w.n, real); break;
        case 4: tile<4>(blocks, xt, nb, n0, n1, yt, w.n, real); break;
        case 2: tile<2>(blocks, xt, nb, n0, n1, yt, w.n, real); break;
        default: tile<1>(blocks, xt, nb, n0, n1, yt, w.n, real);
        }
    }
}

void product_rows(const BlockWeight &w, const float *x, int64_t rows, int64_t n0, int64_t n1,
                  float *y) {
    if (w.kind == Q4_1)
        rows_of(Q4_1Blocks(w), w, x, rows, n0, n1, y);
    else
        rows_of(Q8_0Blocks(w), w, x, rows, n0, n1, y);
}

template <class Blocks>
void dequant_with(const Blocks &blocks, int64_t b0, int64_t b1, float *out) {
    for (int64_t b = b0; b < b1; b++) {
        __m512 lo, hi;
        blocks(b, lo, hi);
        _mm512_storeu_ps(out + b * QK, lo);
        _mm512_storeu_ps(out + b * QK + QK / 2, hi);
    }
}

void dequant(const BlockWeight &w, int64_t b0, int64_t b1, float *out) {
    if (w.kind == Q4_1)
        dequant_with(Q4_1Blocks(w), b0, b1, out);
    else
        dequant_with(Q8_0Blocks(w), b0, b1, out);
}

/* exp(x): x = n ln2 + r, |r| <= ln2 / 2; exp(r) by Cephes' expf polynomial; times 2^n
 * (scalef). Clamped where float32's exp overflows or is zero anyway. */
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                      _mm512_set1_ps(-103.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline __mmask16 first(int64_t count) {
    return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

void silu_row(const float *g, const float *u, float *o, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 in = first(n - i);
        const __m512 gi = _mm512_maskz_loadu_ps(in, g + i), ui = _mm512_maskz_loadu_ps(in, u + i);
        const __m512 silu = _mm512_div_ps(gi, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, gi))));
        _mm512_mask_storeu_ps(o + i, in, _mm512_mul_ps(silu, ui));
    }
}

/* dim a multiple of 16 up to 256 (the query and the output in registers); the
 * reference otherwise. */
void attend_head(const float *q, const float *k, const float *v, const uint8_t *seen,
                 int64_t columns, int64_t dim, float scale, float *p, float *o) {
    if (dim % 16 || dim > 256) {
        reference_variant.attend_head(q, k, v, seen, columns, dim, scale, p, o);
        return;
    }
    const int64_t vecs = dim / 16;
    __m512 acc[16], qr[16];
    for (int64_t c = 0; c < vecs; c++) qr[c] = _mm512_loadu_ps(q + 16 * c);
    float top = -INFINITY;
    for (int64_t j = 0; j < columns; j++) {
        if (seen && !seen[j]) {
            p[j] = -INFINITY;
            continue;
        }
        __m512 s = _mm512_mul_ps(qr[0], _mm512_loadu_ps(k + j * dim));
        for (int64_t c = 1; c < vecs; c++)
            s = _mm512_fmadd_ps(qr[c], _mm512_loadu_ps(k + j * dim + 16 * c), s);
        p[j] = _mm512_reduce_add_ps(s) * scale;
        top = p[j] > top ? p[j] : top;
    }
    __m512 total = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(top);
    for (int64_t j = 0; j < columns; j += 16) {
        const __mmask16 in = first(columns - j);
        const __m512 pj = _mm512_maskz_loadu_ps(in, p + j);
        const __mmask16 seen_j = in & _mm512_cmp_ps_mask(pj, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
        const __m512 e = _mm512_maskz_mov_ps(seen_j, exp512(_mm512_sub_ps(pj, shift)));
        _mm512_mask_storeu_ps(p + j, in, e); /* masked columns: exactly 0 */
        total = _mm512_add_ps(total, e);
    }
    for (int64_t c = 0; c < vecs; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < columns; j++) {
        const __m512 pj = _mm512_set1_ps(p[j]);
        for (int64_t c = 0; c < vecs; c++)
            acc[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + j * dim + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t c = 0; c < vecs; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], inv));
}

}  // namespace

const Variant avx512_variant = {
    "avx512", "AVX-512 F/BW/VL, FMA and F16C", supported, true, product_rows,
    q8_product512<MaddDot512, MaddDot>, dequant, silu_row, attend_head,
    packed_product512<MaddAcc512>,
};

/* The same with the 8-bit products on VNNI's vpdpbusd (avx512_vnni.cpp): one
 * instruction where maddubs and madd take two. */
const Variant avx512vnni_variant = {
    "avx512vnni", "AVX-512 F/BW/VL with VNNI, FMA and F16C", supported_vnni, true, product_rows,
    avx512vnni_product_q8, dequant, silu_row, attend_head, avx512vnni_product_packed,
};

}  // namespace omni
#endif
