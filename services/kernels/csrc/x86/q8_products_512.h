/* The 8-bit-activation products on 512-bit vectors, for the AVX-512 variants (with
 * VNNI and without): two blocks a vector, so each instruction of a block's dot product,
 * its conversion and its scaling does the work of two in q8_products.h (whose 256-bit
 * code takes an odd last block). A pair's scales are two broadcasts in one vector,
 * [d_j x 8, d_j+1 x 8], d_w's shared by the tile's activation rows. Included after the
 * file's target pragma, after q8_products.h, with the file's dot products. */
#pragma once

namespace omni {
namespace {

/* [v0 x 8, v1 x 8] from two floats. */
inline __m512 pair_of(__m128 two) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(two));
}

inline __m512 half_pair(const uint16_t *d) {
    int32_t bits;
    std::memcpy(&bits, d, sizeof bits);
    return pair_of(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

struct Q4_1Pairs {
    const uint8_t *qs;
    explicit Q4_1Pairs(const BlockWeight &w) : qs(static_cast<const uint8_t *>(w.qs)) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * (QK / 2)); }
    /* blocks `block` and `block` + 1 as [low nibbles, high nibbles] each */
    __m512i operator()(int64_t block) const {
        const __m512i raw = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + block * (QK / 2))));
        const __m512i twice = _mm512_shuffle_i64x2(raw, raw, _MM_SHUFFLE(1, 1, 0, 0));
        const __m512i shift = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004,
                                                0, 0, 0x0004000400040004, 0x0004000400040004);
        return _mm512_and_si512(_mm512_srlv_epi16(twice, shift), _mm512_set1_epi8(0x0F));
    }
    template <class Dot>
    static __m512i dot(__m512i w, __m512i x) {
        return Dot::unsigned_signed(w, x);
    }
};

struct Q8_0Pairs {
    const int8_t *qs;
    explicit Q8_0Pairs(const BlockWeight &w) : qs(static_cast<const int8_t *>(w.qs)) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * QK); }
    __m512i operator()(int64_t block) const {
        return _mm512_loadu_si512(qs + block * QK);
    }
    /* |w| times x negated where w is negative (AVX-512 has no sign_epi8) */
    template <class Dot>
    static __m512i dot(__m512i w, __m512i x) {
        const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
        return Dot::unsigned_signed(_mm512_abs_epi8(w), signed_x);
    }
};

template <int BT, int R, class Dot, class Dot256, class Pairs, class Bytes>
void q8_tile512(const Pairs &pairs, const Bytes &blocks, const BlockWeight &w, const Q8Rows &x,
                int64_t b0, int64_t real, int64_t n0, int64_t n1, float *y) {
    const int64_t nb = w.k / QK;
    const int8_t *xq[BT];
    const float *xd[BT], *xd8[BT];
    for (int b = 0; b < BT; b++) {
        const int64_t row = b0 + (b < real ? b : real - 1);
        xq[b] = x.q + row * w.k;
        xd[b] = x.d + row * nb;
        xd8[b] = x.d8 + row * nb * 8;
    }
    for (int64_t r0 = n0; r0 < n1; r0 += R) {
        int64_t rows[R];
        for (int k = 0; k < R; k++) rows[k] = r0 + k < n1 ? r0 + k : n1 - 1;
        __m512 acc[BT][R];
        for (int b = 0; b < BT; b++)
            for (int k = 0; k < R; k++) acc[b][k] = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 2 <= nb; j += 2)
            for (int k = 0; k < R; k++) {
                const int64_t block = rows[k] * nb + j;
                if (rows[k] + PREFETCH_ROWS < w.n) pairs.prefetch(block + PREFETCH_ROWS * nb);
                const __m512i wq = pairs(block);
                const __m512 dw = half_pair(w.d + block);
                for (int b = 0; b < BT; b++) {
                    const __m512i xb = _mm512_loadu_si512(xq[b] + j * QK);
                    const __m512 p = _mm512_cvtepi32_ps(Pairs::template dot<Dot>(wq, xb));
                    acc[b][k] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, _mm512_loadu_ps(xd8[b] + j * 8)), acc[b][k]);
                }
            }
        if (j < nb) /* an odd last block, 256 bits wide */
            for (int k = 0; k < R; k++) {
                const int64_t block = rows[k] * nb + j;
                const __m256i wq = blocks(block);
                const float dw = _cvtsh_ss(w.d[block]);
                for (int b = 0; b < BT; b++) {
                    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq[b] + j * QK));
                    const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(Bytes::template dot<Dot256>(wq, xb)),
                                                   _mm256_set1_ps(dw * xd[b][j]));
                    acc[b][k] = _mm512_add_ps(acc[b][k], _mm512_zextps256_ps512(p));
                }
            }
        for (int k = 0; k < R && r0 + k < n1; k++)
            for (int b = 0; b < real; b++) {
                float sum = _mm512_reduce_add_ps(acc[b][k]);
                if constexpr (Bytes::has_min)
                    sum += min_sum(w.m + rows[k] * nb, x.s + (b0 + b) * nb, nb);
                y[(b0 + b) * w.n + rows[k]] = sum;
            }
    }
}

template <class Dot, class Dot256, class Pairs, class Bytes>
void q8_rows512(const Pairs &pairs, const Bytes &blocks, const BlockWeight &w, const Q8Rows &x,
                int64_t rows, int64_t n0, int64_t n1, float *y) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        switch (bt) {
        case 8: q8_tile512<8, 2, Dot, Dot256>(pairs, blocks, w, x, b0, real, n0, n1, y); break;
        case 4: q8_tile512<4, 4, Dot, Dot256>(pairs, blocks, w, x, b0, real, n0, n1, y); break;
        case 2: q8_tile512<2, 4, Dot, Dot256>(pairs, blocks, w, x, b0, real, n0, n1, y); break;
        default: q8_tile512<1, 4, Dot, Dot256>(pairs, blocks, w, x, b0, real, n0, n1, y);
        }
    }
}

template <class Dot, class Dot256>
void q8_product512(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0, int64_t n1,
                   float *y) {
    if (w.kind == Q4_1)
        q8_rows512<Dot, Dot256>(Q4_1Pairs(w), Q4_1Bytes(w), w, x, rows, n0, n1, y);
    else
        q8_rows512<Dot, Dot256>(Q8_0Pairs(w), Q8_0Bytes(w), w, x, rows, n0, n1, y);
}

struct MaddDot512 {
    static __m512i unsigned_signed(__m512i u, __m512i s) {
        return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
    }
};

}  // namespace
}  // namespace omni
