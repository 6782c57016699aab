/* The 8-bit-activation products over a packed Q4_1 weight (kernels.h: pack_q4_1), on
 * 512-bit vectors: a vector is a whole group of 16 rows. For one activation row, a
 * block is 8 integer dot products (a chunk's low or high nibbles against 4 activation
 * bytes broadcast) into two accumulators (the low nibbles' and the high's, so that
 * two chains run side by side), converted and scaled by d_w d_x, m_w s_x into a
 * second accumulator. `Acc` is the integer dot: VNNI's vpdpbusd into int32, or
 * maddubs added as int16 (four a lane, at most 15240) and one madd with ones at the
 * end. Activation rows go in tiles of 8, 4, 2 or 1, a last tile's missing rows
 * repeating its last row (computed, never stored). Included after the file's target
 * pragma, after q8_packed.h. */
#pragma once

namespace omni {
namespace {

struct MaddAcc512 {
    static __m512i step(__m512i acc, __m512i u, __m512i s) {
        return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s));
    }
    static __m512i finish(__m512i acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
};

template <int BT, class Acc>
void packed_tile512(const BlockWeight &w, const Q8Rows &x, int64_t b0, int64_t real, int64_t g0,
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
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = g0; g < g1; g++) {
        __m512 acc[BT], mins[BT];
        for (int b = 0; b < BT; b++) acc[b] = mins[b] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *record = w.packed + (g * nb + j) * PACKED_RECORD;
            if (g + 2 < groups)
                for (int line = 0; line < PACKED_RECORD; line += 64)
                    prefetch_weight(record + 2 * nb * PACKED_RECORD + line);
            __m512i lo[4], hi[4];
            for (int t = 0; t < 4; t++) {
                const __m512i raw = _mm512_loadu_si512(record + t * 64);
                lo[t] = _mm512_and_si512(raw, nibble);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            }
            const uint16_t *dm = reinterpret_cast<const uint16_t *>(record + 256);
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(dm)));
            const __m512 mw = _mm512_cvtph_ps(
                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(dm + PACK_ROWS)));
            for (int b = 0; b < BT; b++) {
                const int8_t *q = xq[b] + j * QK;
                __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++) {
                    low = Acc::step(low, lo[t], _mm512_set1_epi32(four_bytes(q + 4 * t)));
                    high = Acc::step(high, hi[t], _mm512_set1_epi32(four_bytes(q + 16 + 4 * t)));
                }
                const __m512 dot =
                    _mm512_cvtepi32_ps(_mm512_add_epi32(Acc::finish(low), Acc::finish(high)));
                acc[b] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(xd[b][j])), acc[b]);
                mins[b] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[b][j]), mins[b]);
            }
        }
        for (int b = 0; b < real; b++)
            _mm512_storeu_ps(y + (b0 + b) * w.n + g * PACK_ROWS, _mm512_add_ps(acc[b], mins[b]));
    }
}

template <class Acc>
void packed_product512(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                       int64_t n1, float *y) {
    const int64_t g0 = n0 / PACK_ROWS, g1 = n1 / PACK_ROWS;
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        switch (bt) {
        case 8: packed_tile512<8, Acc>(w, x, b0, real, g0, g1, y); break;
        case 4: packed_tile512<4, Acc>(w, x, b0, real, g0, g1, y); break;
        case 2: packed_tile512<2, Acc>(w, x, b0, real, g0, g1, y); break;
        default: packed_tile512<1, Acc>(w, x, b0, real, g0, g1, y);
        }
    }
}

}  // namespace
}  // namespace omni
