/* The 8-bit-activation products over a packed weight (kernels.h: pack_blocks), on
 * 512-bit vectors: a vector is a whole group of 16 rows, and a block against one
 * activation row is one integer dot a chunk (4 activation bytes broadcast), in two
 * chains side by side, then converted and scaled by d_w d_x (Q4_1's m_w s_x into a
 * second accumulator). `Acc` is the integer dot:
 * - VNNI (avx512_vnni.cpp): vpdpbusd into int32. Q8_0's weights are signed and
 *   vpdpbusd's first operand unsigned, so the activations go in as x + 128 (the
 *   broadcast bytes' top bits flipped) and 128 times the block's weight sum, one
 *   vpdpbusd of ones a chunk for all the tile's rows, comes off again: exact.
 * - AVX-512BW (`MaddAcc512`): maddubs. Q4_1 adds four a chain as int16 (at most
 *   15240) before one madd; Q8_0 takes |w| against x with w's sign, each maddubs its
 *   own madd (at most 2 * 128 * 127 a lane).
 * Every variant's sums are the same integers and the same float32 operations after
 * them, so all are equal bit for bit. Activation rows go in tiles of 8, 4, 2 or 1, a
 * last tile's missing rows repeating its last row (computed, never stored). Included
 * after the file's target pragma, after q8_packed.h. */
#pragma once

namespace omni {
namespace {

/* A group's block of Q8_0 weights in registers: its eight chunks, and what the dot
 * needs of them beside (`Acc::Q8Prep`). */
struct Q8Chunks {
    __m512i w[8];
};

struct MaddAcc512 {
    static __m512i q4_1(const __m512i *lo, const __m512i *hi, const int8_t *q) {
        __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            low = _mm512_add_epi16(low, _mm512_maddubs_epi16(lo[t], _mm512_set1_epi32(four_bytes(q + 4 * t))));
            high = _mm512_add_epi16(high, _mm512_maddubs_epi16(hi[t], _mm512_set1_epi32(four_bytes(q + 16 + 4 * t))));
        }
        const __m512i ones = _mm512_set1_epi16(1);
        return _mm512_add_epi32(_mm512_madd_epi16(low, ones), _mm512_madd_epi16(high, ones));
    }
    struct Q8Prep {
        __m512i magnitude[8];
        explicit Q8Prep(const Q8Chunks &c) {
            for (int t = 0; t < 8; t++) magnitude[t] = _mm512_abs_epi8(c.w[t]);
        }
    };
    static __m512i q8_0(const Q8Chunks &c, const Q8Prep &p, const int8_t *q) {
        const __m512i ones = _mm512_set1_epi16(1);
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {
            const __m512i x = _mm512_set1_epi32(four_bytes(q + 4 * t));
            const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c.w[t]), _mm512_setzero_si512(), x);
            const __m512i pairs = _mm512_madd_epi16(_mm512_maddubs_epi16(p.magnitude[t], signed_x), ones);
            if (t % 2) odd = _mm512_add_epi32(odd, pairs);
            else even = _mm512_add_epi32(even, pairs);
        }
        return _mm512_add_epi32(even, odd);
    }
};

template <int BT, class Acc>
void packed_tile512(const BlockWeight &w, const Q8Rows &x, int64_t b0, int64_t real, int64_t g0,
                    int64_t g1, float *y) {
    const int64_t nb = w.k / QK, groups = w.n / PACK_ROWS, bytes = PACKED_RECORD[w.kind];
    const bool q4_1 = w.kind == Q4_1;
    const TileRows<BT> xr(x, w.k, b0, real);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = g0; g < g1; g++) {
        __m512 acc[BT], mins[BT];
        for (int b = 0; b < BT; b++) acc[b] = mins[b] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *record = w.packed + (g * nb + j) * bytes;
            if (g + 2 < groups) prefetch_record(record, nb, bytes);
            __m512i dots[BT];
            if (q4_1) {
                __m512i lo[4], hi[4];
                for (int t = 0; t < 4; t++) {
                    const __m512i raw = _mm512_loadu_si512(record + t * 64);
                    lo[t] = _mm512_and_si512(raw, nibble);
                    hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
                }
                for (int b = 0; b < BT; b++) dots[b] = Acc::q4_1(lo, hi, xr.q[b] + j * QK);
            } else {
                Q8Chunks c;
                for (int t = 0; t < 8; t++) c.w[t] = _mm512_loadu_si512(record + t * 64);
                const typename Acc::Q8Prep prep(c);
                for (int b = 0; b < BT; b++) dots[b] = Acc::q8_0(c, prep, xr.q[b] + j * QK);
            }
            const uint16_t *dm = reinterpret_cast<const uint16_t *>(record + (q4_1 ? 4 : 8) * 64);
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(dm)));
            for (int b = 0; b < BT; b++)
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[b]),
                                         _mm512_mul_ps(dw, _mm512_set1_ps(xr.d[b][j])), acc[b]);
            if (q4_1) {
                const __m512 mw = _mm512_cvtph_ps(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(dm + PACK_ROWS)));
                for (int b = 0; b < BT; b++)
                    mins[b] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr.s[b][j]), mins[b]);
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
