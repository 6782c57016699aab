/* The 8-bit-activation products over a packed weight (kernels.h: pack_blocks), on
 * 256-bit vectors (AVX2): a vector is 8 rows of a group (a chunk's half), each 32-bit
 * lane a row, and a block against one activation row is one integer dot a chunk (4
 * activation bytes broadcast) giving 8 rows at once, then converted and scaled by
 * d_w d_x into the accumulator (Q4_1's m_w s_x into a second one): about a third of
 * the instructions of q8_products.h's block a row.
 *
 * Q4_1: a chunk's low and high nibbles, 8 maddubs added as int16 (each lane at most
 * 2 * 15 * 127, eight of them 30480: no overflow, activations are never -128), one
 * madd with ones into int32. Q8_0: maddubs takes one unsigned operand, so |w| against
 * x with w's sign (at most 2 * 128 * 127 a lane: each maddubs its own madd).
 * Activation rows go in tiles of 4, 2 or 1 (16 vector registers), a last tile's
 * missing rows repeating its last row (computed, never stored). Included after the
 * file's target pragma. */
#pragma once

namespace omni {
namespace {

inline int32_t four_bytes(const int8_t *at) {
    int32_t v;
    std::memcpy(&v, at, sizeof v);
    return v;
}

/* The activation rows of a tile: their quants, scales and (Q4_1) block sums. */
template <int BT>
struct TileRows {
    const int8_t *q[BT];
    const float *d[BT], *s[BT];
    TileRows(const Q8Rows &x, int64_t k, int64_t b0, int64_t real) {
        const int64_t nb = k / QK;
        for (int b = 0; b < BT; b++) {
            const int64_t row = b0 + (b < real ? b : real - 1);
            q[b] = x.q + row * k;
            d[b] = x.d + row * nb;
            s[b] = x.s + row * nb;
        }
    }
};

/* The records two groups ahead into L2 (PREFETCH_ROWS of kernels.h: 32 rows). */
inline void prefetch_record(const uint8_t *record, int64_t nb, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64)
        prefetch_weight(record + 2 * nb * bytes + line);
}

template <int BT>
void packed_tile256(const BlockWeight &w, const Q8Rows &x, int64_t b0, int64_t real, int64_t g0,
                    int64_t g1, float *y) {
    const int64_t nb = w.k / QK, groups = w.n / PACK_ROWS, bytes = PACKED_RECORD[w.kind];
    const bool q4_1 = w.kind == Q4_1;
    const int chunks = q4_1 ? 4 : 8;
    const TileRows<BT> xr(x, w.k, b0, real);
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t g = g0; g < g1; g++)
        for (int half = 0; half < 2; half++) {
            __m256 acc[BT], mins[BT];
            for (int b = 0; b < BT; b++) acc[b] = mins[b] = _mm256_setzero_ps();
            for (int64_t j = 0; j < nb; j++) {
                const uint8_t *record = w.packed + (g * nb + j) * bytes;
                if (half == 0 && g + 2 < groups) prefetch_record(record, nb, bytes);
                __m256i sums[BT];
                for (int b = 0; b < BT; b++) sums[b] = _mm256_setzero_si256();
                for (int t = 0; t < chunks; t++) {
                    const __m256i raw = _mm256_loadu_si256(
                        reinterpret_cast<const __m256i *>(record + t * 64 + half * 32));
                    if (q4_1) {
                        const __m256i lo = _mm256_and_si256(raw, nibble);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                        for (int b = 0; b < BT; b++) {
                            const int8_t *q = xr.q[b] + j * QK;
                            const __m256i xl = _mm256_set1_epi32(four_bytes(q + 4 * t));
                            const __m256i xh = _mm256_set1_epi32(four_bytes(q + 16 + 4 * t));
                            sums[b] = _mm256_add_epi16(sums[b], _mm256_maddubs_epi16(lo, xl));
                            sums[b] = _mm256_add_epi16(sums[b], _mm256_maddubs_epi16(hi, xh));
                        }
                    } else {
                        const __m256i magnitude = _mm256_sign_epi8(raw, raw);
                        for (int b = 0; b < BT; b++) {
                            const __m256i xb = _mm256_set1_epi32(four_bytes(xr.q[b] + j * QK + 4 * t));
                            const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xb, raw));
                            sums[b] = _mm256_add_epi32(sums[b], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
                const uint16_t *dm = reinterpret_cast<const uint16_t *>(record + chunks * 64) + half * 8;
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(dm)));
                for (int b = 0; b < BT; b++) {
                    const __m256i dot = q4_1 ? _mm256_madd_epi16(sums[b], ones) : sums[b];
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                             _mm256_mul_ps(dw, _mm256_set1_ps(xr.d[b][j])), acc[b]);
                }
                if (q4_1) {
                    const __m256 mw = _mm256_cvtph_ps(
                        _mm_loadu_si128(reinterpret_cast<const __m128i *>(dm + PACK_ROWS)));
                    for (int b = 0; b < BT; b++)
                        mins[b] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xr.s[b][j]), mins[b]);
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
