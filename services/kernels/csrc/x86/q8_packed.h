/* The 8-bit-activation products over a packed Q4_1 weight (kernels.h: pack_q4_1), on
 * 256-bit vectors (AVX2): a vector is 8 rows of a group (a chunk's half), each 32-bit
 * lane a row. For one activation row, a block is 8 maddubs (a chunk's low or high
 * nibbles against 4 activation bytes broadcast), added as int16 (each maddubs lane at
 * most 2 * 15 * 127, eight of them 30480: no overflow, activations are never -128),
 * one madd with ones into int32, then converted and scaled by d_w d_x into the
 * accumulator, m_w s_x into a second one: about a third of the instructions of
 * q8_products.h's block a row. Activation rows go in tiles of 4, 2 or 1 (16 vector
 * registers), a last tile's missing rows repeating its last row (computed, never
 * stored). Included after the file's target pragma. */
#pragma once

namespace omni {
namespace {

inline int32_t four_bytes(const int8_t *at) {
    int32_t v;
    std::memcpy(&v, at, sizeof v);
    return v;
}

template <int BT>
void packed_tile256(const BlockWeight &w, const Q8Rows &x, int64_t b0, int64_t real, int64_t g0,
                    int64_t g1, float *y) {
    const int64_t nb = w.k / QK, groups = w.n / PACK_ROWS;
    const int8_t *xq[BT];
    const float *xd[BT], *xs[BT];
    for (int b = 0; b < BT; b++) {
        const int64_t row = b0 + (b < real ? b : real - 1);
        xq[b] = x.q + row * w.k;
        xd[b] = x.d + row * nb;
        xs[b] = x.s + row * nb;
    }
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t g = g0; g < g1; g++)
        for (int half = 0; half < 2; half++) {
            __m256 acc[BT], mins[BT];
            for (int b = 0; b < BT; b++) acc[b] = mins[b] = _mm256_setzero_ps();
            for (int64_t j = 0; j < nb; j++) {
                const uint8_t *record = w.packed + (g * nb + j) * PACKED_RECORD;
                if (half == 0 && g + 2 < groups)
                    for (int line = 0; line < PACKED_RECORD; line += 64)
                        prefetch_weight(record + 2 * nb * PACKED_RECORD + line);
                __m256i sums[BT];
                for (int b = 0; b < BT; b++) sums[b] = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    const __m256i raw = _mm256_loadu_si256(
                        reinterpret_cast<const __m256i *>(record + t * 64 + half * 32));
                    const __m256i lo = _mm256_and_si256(raw, nibble);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                    for (int b = 0; b < BT; b++) {
                        const int8_t *q = xq[b] + j * QK;
                        sums[b] = _mm256_add_epi16(
                            sums[b], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(q + 4 * t))));
                        sums[b] = _mm256_add_epi16(
                            sums[b], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(q + 16 + 4 * t))));
                    }
                }
                const uint16_t *dm = reinterpret_cast<const uint16_t *>(record + 256) + half * 8;
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(dm)));
                const __m256 mw = _mm256_cvtph_ps(
                    _mm_loadu_si128(reinterpret_cast<const __m128i *>(dm + PACK_ROWS)));
                for (int b = 0; b < BT; b++) {
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[b], ones));
                    acc[b] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xd[b][j])), acc[b]);
                    mins[b] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[b][j]), mins[b]);
                }
            }
            for (int b = 0; b < real; b++)
                _mm256_storeu_ps(y + (b0 + b) * w.n + g * PACK_ROWS + half * 8,
                                 _mm256_add_ps(acc[b], mins[b]));
        }
}

inline void packed_product256(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                       int64_t n1, float *y) {
    const int64_t g0 = n0 / PACK_ROWS, g1 = n1 / PACK_ROWS;
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        const int64_t left = rows - b0;
        bt = left >= 3 ? 4 : left;
        const int64_t real = left < bt ? left : bt;
        switch (bt) {
        case 4: packed_tile256<4>(w, x, b0, real, g0, g1, y); break;
        case 2: packed_tile256<2>(w, x, b0, real, g0, g1, y); break;
        default: packed_tile256<1>(w, x, b0, real, g0, g1, y);
        }
    }
}

}  // namespace
}  // namespace omni
