/* The 8-bit-activation products on 256-bit vectors, shared by the x86 variants: each
 * file includes this after its own target pragma and instantiates it with its integer
 * dot (AVX2's maddubs + madd; AVX-512 VNNI's vpdpbusd), the rest the same code.
 *
 * A block of one weight row against one activation row: its 32 weight bytes (Q4_1's
 * nibbles 0..15 unsigned; Q8_0's int8, its sign moved onto the activations, as
 * maddubs and vpdpbusd take one unsigned and one signed operand) dotted with the 32
 * activation bytes into eight int32 lanes, exactly (maddubs' int16 pairs reach at
 * most 2 * 128 * 127, under 2^15: activations are never -128), then converted and
 * scaled by d_w d_x into eight float32 accumulators. Q4_1's minimums are one float32
 * dot product a row pair, m_w . s_x over the blocks. Activation rows go in tiles of
 * 8, 4, 2 or 1 against 1, 2, 4 and 4 weight rows (eight or four accumulators), a last
 * tile's missing rows repeating its last row (computed, never stored). */
#pragma once

namespace omni {
namespace {

inline float q8_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

struct Q4_1Bytes {
    const uint8_t *qs;
    static constexpr bool has_min = true;
    explicit Q4_1Bytes(const BlockWeight &w) : qs(static_cast<const uint8_t *>(w.qs)) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * (QK / 2)); }
    /* weights 0-15 from the low nibbles, 16-31 from the high */
    __m256i operator()(int64_t block) const {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + block * (QK / 2)));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    }
    template <class Dot>
    static __m256i dot(__m256i w, __m256i x) {
        return Dot::unsigned_signed(w, x);
    }
};

struct Q8_0Bytes {
    const int8_t *qs;
    static constexpr bool has_min = false;
    explicit Q8_0Bytes(const BlockWeight &w) : qs(static_cast<const int8_t *>(w.qs)) {}
    void prefetch(int64_t block) const { prefetch_weight(qs + block * QK); }
    __m256i operator()(int64_t block) const {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + block * QK));
    }
    /* |w| (as unsigned: -128 is 128) times x with w's sign */
    template <class Dot>
    static __m256i dot(__m256i w, __m256i x) {
        return Dot::unsigned_signed(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    }
};

/* sum_j m[j] * s[j] over a row's blocks (Q4_1's minimums times the block sums). */
inline float min_sum(const uint16_t *m, const float *s, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(m + j))),
                              _mm256_loadu_ps(s + j), acc);
    float total = q8_sum8(acc);
    for (; j < nb; j++) total += _cvtsh_ss(m[j]) * s[j];
    return total;
}

template <int BT, int R, class Dot, class Bytes>
void q8_tile(const Bytes &blocks, const BlockWeight &w, const Q8Rows &x, int64_t b0, int64_t real,
             int64_t n0, int64_t n1, float *y) {
    const int64_t nb = w.k / QK;
    const int8_t *xq[BT];
    const float *xd8[BT];
    for (int b = 0; b < BT; b++) {
        const int64_t row = b0 + (b < real ? b : real - 1);
        xq[b] = x.q + row * w.k;
        xd8[b] = x.d8 + row * nb * 8;
    }
    for (int64_t r0 = n0; r0 < n1; r0 += R) {
        int64_t rows[R];
        for (int k = 0; k < R; k++) rows[k] = r0 + k < n1 ? r0 + k : n1 - 1;
        __m256 acc[BT][R];
        for (int b = 0; b < BT; b++)
            for (int k = 0; k < R; k++) acc[b][k] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; j++)
            for (int k = 0; k < R; k++) {
                const int64_t block = rows[k] * nb + j;
                if (rows[k] + PREFETCH_ROWS < w.n) blocks.prefetch(block + PREFETCH_ROWS * nb);
                const __m256i wq = blocks(block);
                const __m256 dw = _mm256_set1_ps(_cvtsh_ss(w.d[block]));
                for (int b = 0; b < BT; b++) {
                    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xq[b] + j * QK));
                    const __m256 p = _mm256_cvtepi32_ps(Bytes::template dot<Dot>(wq, xb));
                    acc[b][k] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, _mm256_loadu_ps(xd8[b] + j * 8)), acc[b][k]);
                }
            }
        for (int k = 0; k < R && r0 + k < n1; k++)
            for (int b = 0; b < real; b++) {
                float sum = q8_sum8(acc[b][k]);
                if constexpr (Bytes::has_min)
                    sum += min_sum(w.m + rows[k] * nb, x.s + (b0 + b) * nb, nb);
                y[(b0 + b) * w.n + rows[k]] = sum;
            }
    }
}

template <class Dot, class Bytes>
void q8_rows_of(const Bytes &blocks, const BlockWeight &w, const Q8Rows &x, int64_t rows,
                int64_t n0, int64_t n1, float *y) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        switch (bt) {
        case 8: q8_tile<8, 1, Dot>(blocks, w, x, b0, real, n0, n1, y); break;
        case 4: q8_tile<4, 2, Dot>(blocks, w, x, b0, real, n0, n1, y); break;
        case 2: q8_tile<2, 4, Dot>(blocks, w, x, b0, real, n0, n1, y); break;
        default: q8_tile<1, 4, Dot>(blocks, w, x, b0, real, n0, n1, y);
        }
    }
}

template <class Dot>
void q8_product(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0, int64_t n1,
                float *y) {
    if (w.kind == Q4_1)
        q8_rows_of<Dot>(Q4_1Bytes(w), w, x, rows, n0, n1, y);
    else
        q8_rows_of<Dot>(Q8_0Bytes(w), w, x, rows, n0, n1, y);
}

/* maddubs (u8 x s8 pairs into int16) then madd with ones (pairs into int32). */
struct MaddDot {
    static __m256i unsigned_signed(__m256i u, __m256i s) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
    }
};

}  // namespace
}  // namespace omni
