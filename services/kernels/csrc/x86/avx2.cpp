/* The AVX2 variant (AVX2 with FMA and F16C: Intel from Haswell, AMD from Zen 1): the
 * most common server CPUs without AVX-512.
 *
 * Products: over activation tiles of 8, 4, 2 or 1 rows packed by pack_tiles, 1, 2, 4
 * and 4 weight rows at a time (eight or four accumulators a pass: one accumulator a
 * row took four dependent FMAs a block, and a 1-row product, a decode step's, was
 * bound by their latency); a block is dequantised once into registers for the tile's
 * rows, q converted from its nibble. The exp of SiLU and of the softmax is Cephes'
 * expf polynomial, as on AVX-512, with 2^n built in the exponent bits. */
#if defined(__x86_64__) && !defined(OMNI_GENERIC_KERNELS)
#include <immintrin.h>

#include "../kernels.h"

namespace omni {
namespace {
/* Before the pragma, as the includes are: the check itself, and whatever they define
 * inline, stay plain x86-64 (the linker keeps one copy of an inline function, and it
 * must not be one built for an instruction set the CPU may lack). */
bool supported() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && os_saves(XCR0_AVX);
}
}  // namespace
}  // namespace omni

#pragma GCC target("avx2,fma,f16c")

#include "q8_packed.h"
#include "q8_products.h"

namespace omni {
namespace {

/* Four vectors of eight: weights 0-7, 8-15, 16-23, 24-31 of a block. (d * q) + m as
 * one FMA: d is a half (11 significant bits) and q at most 4 bits, so d * q is exact
 * in float32 and one rounding of d * q + m is the two roundings gguf-py makes. */
struct Q4_1Blocks {
    const uint8_t *qs;
    const uint16_t *d, *m;
    explicit Q4_1Blocks(const BlockWeight &w)
        : qs(static_cast<const uint8_t *>(w.qs)), d(w.d), m(w.m) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * (QK / 2)); }
    void operator()(int64_t block, __m256 *w) const {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + block * (QK / 2)));
        const __m128i nibble = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, nibble);                      /* weights 0-15 */
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);   /* 16-31 */
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[block]));
        const __m256 min = _mm256_set1_ps(_cvtsh_ss(m[block]));
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), scale, min);
    }
};

struct Q8_0Blocks {
    const int8_t *qs;
    const uint16_t *d;
    explicit Q8_0Blocks(const BlockWeight &w) : qs(static_cast<const int8_t *>(w.qs)), d(w.d) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * QK); }
    void operator()(int64_t block, __m256 *w) const {
        const int8_t *q = qs + block * QK;
        const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[block]));
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i *>(q + 8 * i)))),
                scale);
    }
};

inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Output rows [n0, n1) for one tile of BT rows (xp packed; `real` not padding), R
 * weight rows at a time: BT * R accumulators, so that enough FMA chains are in flight
 * (one chain takes four dependent FMAs a block) while the accumulators, a block's
 * weights and an activation vector still fit the 16 registers. A row's sum is the
 * same whatever BT and R: each (row, weight row) adds its blocks in order, a block's
 * four vectors in order. A last pass past n1 recomputes row n1 - 1 and stores once. */
template <int BT, int R, class Blocks>
void tile(const Blocks &blocks, const float *xp, int64_t nb, int64_t n0, int64_t n1, float *y,
          int64_t n, int64_t real) {
    const int64_t ahead = PREFETCH_ROWS * nb;
    for (int64_t r0 = n0; r0 < n1; r0 += R) {
        int64_t rows[R];
        for (int k = 0; k < R; k++) rows[k] = r0 + k < n1 ? r0 + k : n1 - 1;
        __m256 acc[BT][R];
        for (int b = 0; b < BT; b++)
            for (int k = 0; k < R; k++) acc[b][k] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            const float *xj = xp + j * (BT * QK);
            for (int k = 0; k < R; k++) {
                __m256 w[4];
                if (rows[k] + PREFETCH_ROWS < n) blocks.prefetch(rows[k] * nb + j + ahead);
                blocks(rows[k] * nb + j, w);
                for (int b = 0; b < BT; b++)
                    for (int i = 0; i < 4; i++)
                        acc[b][k] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xj + b * QK + 8 * i), acc[b][k]);
            }
        }
        for (int k = 0; k < R && r0 + k < n1; k++)
            for (int b = 0; b < real; b++) y[b * n + r0 + k] = sum8(acc[b][k]);
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
        case 8: tile<8, 1>(blocks, xt, nb, n0, n1, yt, w.n, real); break;
        case 4: tile<4, 2>(blocks, xt, nb, n0, n1, yt, w.n, real); break;
        case 2: tile<2, 4>(blocks, xt, nb, n0, n1, yt, w.n, real); break;
        default: tile<1, 4>(blocks, xt, nb, n0, n1, yt, w.n, real);
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
        __m256 w[4];
        blocks(b, w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + b * QK + 8 * i, w[i]);
    }
}

void dequant(const BlockWeight &w, int64_t b0, int64_t b1, float *out) {
    if (w.kind == Q4_1)
        dequant_with(Q4_1Blocks(w), b0, b1, out);
    else
        dequant_with(Q8_0Blocks(w), b0, b1, out);
}

/* exp(x) = 2^n exp(r), as exp512 in avx512.cpp; clamped to [-87.34, 88] so that 2^n
 * stays a normal float whose exponent bits can be written directly. */
inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.3365f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* Lanes 0 .. count - 1 of eight, for maskload and maskstore. */
inline __m256i first(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count < 8 ? count : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

void silu_row(const float *g, const float *u, float *o, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i in = first(n - i);
        const __m256 gi = _mm256_maskload_ps(g + i, in), ui = _mm256_maskload_ps(u + i, in);
        const __m256 silu = _mm256_div_ps(gi, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gi))));
        _mm256_maskstore_ps(o + i, in, _mm256_mul_ps(silu, ui));
    }
}

/* dim a multiple of 8 up to 256; the reference otherwise. */
void attend_head(const float *q, const float *k, const float *v, const uint8_t *seen,
                 int64_t columns, int64_t dim, float scale, float *p, float *o) {
    if (dim % 8 || dim > 256) {
        reference_variant.attend_head(q, k, v, seen, columns, dim, scale, p, o);
        return;
    }
    const int64_t vecs = dim / 8;
    float top = -INFINITY;
    for (int64_t j = 0; j < columns; j++) {
        if (seen && !seen[j]) {
            p[j] = -INFINITY;
            continue;
        }
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k + j * dim));
        for (int64_t c = 1; c < vecs; c++)
            s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + j * dim + 8 * c), s);
        p[j] = sum8(s) * scale;
        top = p[j] > top ? p[j] : top;
    }
    __m256 total = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(top), none = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < columns; j += 8) {
        const __m256i in = first(columns - j);
        const __m256 pj = _mm256_maskload_ps(p + j, in);
        /* masked columns and lanes past the end: exactly 0 */
        const __m256 keep = _mm256_and_ps(_mm256_castsi256_ps(in), _mm256_cmp_ps(pj, none, _CMP_GT_OQ));
        const __m256 e = _mm256_and_ps(keep, exp256(_mm256_sub_ps(pj, shift)));
        _mm256_maskstore_ps(p + j, in, e);
        total = _mm256_add_ps(total, e);
    }
    __m256 acc[32];
    for (int64_t c = 0; c < vecs; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < columns; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int64_t c = 0; c < vecs; c++)
            acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * dim + 8 * c), acc[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum8(total));
    for (int64_t c = 0; c < vecs; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
}

}  // namespace

const Variant avx2_variant = {
    "avx2", "AVX2, FMA and F16C", supported, true, product_rows, q8_product<MaddDot>,
    dequant, silu_row, attend_head, packed_product256,
};

}  // namespace omni
#endif
