/* Linear layers straight from GGUF weight blocks, float32 activations.
 *
 * y[b][n] = sum_k W[n][k] * x[b][k], where W is held in llama.cpp's block formats
 * (32 weights per block) instead of float32: Q4_1 (w = d * q + m, q in 0..15) and
 * Q8_0 (w = d * q, q in -128..127). Each block's scale (and min) stays the file's
 * float16 (converted exactly to float32 per block), and (d * q) + m is rounded twice
 * as gguf-py does, so a weight dequantised by this kernel is exactly the float32 the
 * plain path loads. Only the
 * order of the additions differs from a float32 matmul: the activations are never
 * quantised, unlike llama.cpp's own kernels (which round them to 8 bits).
 *
 * Decoding is memory-bound: a Q4_1 weight is 5 bits where float32 is 32, so one
 * token reads about a sixth of the bytes. With several rows (a batched decode step)
 * each block is dequantised once into registers and used for every row.
 *
 * Layout, for a weight of n rows and k columns (k a multiple of 32):
 *   Q4_1: qs uint8 [n][k/32][16]: byte j holds weight j (low nibble) and j+16 (high);
 *         d, m float16 [n][k/32], as in the file.
 *   Q8_0: qs int8 [n][k/32][32]; d float16 [n][k/32].
 * x is float32 [rows][k], y float32 [rows][n], both contiguous.
 *
 * Threads: OpenMP over output rows. Built against the libgomp that torch loads
 * (same soname), so these loops share torch's thread pool instead of fighting it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#define QK 32
#define ROW_TILE 8

/* IEEE half to float, exactly (every half is a float): the file's scales and mins
 * stay half, as in the file, so a block costs what it costs there. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13); /* inf, nan */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
} /* activation rows per pass over a weight row */

/* ---------------------------------------------------------------- portable path */

static void q4_1_rows_generic(const float *x, int64_t rows, int64_t k, const uint8_t *qs,
                              const uint16_t *d, const uint16_t *m, int64_t n0, int64_t n1,
                              float *y, int64_t n) {
    const int64_t nb = k / QK;
    float w[QK];
    for (int64_t r = n0; r < n1; r++) {
        for (int64_t b0 = 0; b0 < rows; b0 += ROW_TILE) {
            const int64_t bt = rows - b0 < ROW_TILE ? rows - b0 : ROW_TILE;
            float acc[ROW_TILE] = {0};
            for (int64_t j = 0; j < nb; j++) {
                const uint8_t *q = qs + (r * nb + j) * (QK / 2);
                const float dj = half_to_float(d[r * nb + j]), mj = half_to_float(m[r * nb + j]);
                for (int i = 0; i < QK / 2; i++) {
                    w[i] = dj * (float)(q[i] & 0x0F) + mj;
                    w[i + QK / 2] = dj * (float)(q[i] >> 4) + mj;
                }
                for (int64_t b = 0; b < bt; b++) {
                    const float *xb = x + (b0 + b) * k + j * QK;
                    float s = 0.0f;
                    for (int i = 0; i < QK; i++) s += w[i] * xb[i];
                    acc[b] += s;
                }
            }
            for (int64_t b = 0; b < bt; b++) y[(b0 + b) * n + r] = acc[b];
        }
    }
}

static void q8_0_rows_generic(const float *x, int64_t rows, int64_t k, const int8_t *qs,
                              const uint16_t *d, int64_t n0, int64_t n1, float *y, int64_t n) {
    const int64_t nb = k / QK;
    float w[QK];
    for (int64_t r = n0; r < n1; r++) {
        for (int64_t b0 = 0; b0 < rows; b0 += ROW_TILE) {
            const int64_t bt = rows - b0 < ROW_TILE ? rows - b0 : ROW_TILE;
            float acc[ROW_TILE] = {0};
            for (int64_t j = 0; j < nb; j++) {
                const int8_t *q = qs + (r * nb + j) * QK;
                const float dj = half_to_float(d[r * nb + j]);
                for (int i = 0; i < QK; i++) w[i] = dj * (float)q[i];
                for (int64_t b = 0; b < bt; b++) {
                    const float *xb = x + (b0 + b) * k + j * QK;
                    float s = 0.0f;
                    for (int i = 0; i < QK; i++) s += w[i] * xb[i];
                    acc[b] += s;
                }
            }
            for (int64_t b = 0; b < bt; b++) y[(b0 + b) * n + r] = acc[b];
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 path */

/* Activation rows are taken in tiles of 8, then 4, 2 and 1 for what is left. */
static inline int64_t tile_width(int64_t left) {
    return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* x [rows][k] into tiles: tile by tile, each [k/32][its rows][32]; one row is itself. */
static void pack_tiles(const float *x, int64_t rows, int64_t k, float *xp) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        float *tile = xp + b0 * k;
        for (int64_t j = 0; j < k / QK; j++)
            for (int64_t b = 0; b < bt; b++)
                memcpy(tile + (j * bt + b) * QK, x + (b0 + b) * k + j * QK, QK * sizeof(float));
    }
}

#if HAVE_X86
/* Two weight rows at a time: each activation load feeds four FMAs instead of two,
 * which is what bounds a batched step (the products are float32 FMAs). Each output
 * still adds its blocks in the same order as the portable path's. An odd last row
 * is computed twice and stored once.
 *
 * The activation rows come packed tile by tile (pack_tiles: [block][row][32] within
 * a tile), so that a tile's rows sit at fixed offsets from one pointer; a tile is 8,
 * 4, 2 or 1 rows, each width its own function with the width fixed at compile time,
 * so that the accumulators stay in registers and no branch is taken per block. */
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define PAIR_TILE(BT, DEQUANT)                                                              \
    for (int64_t r = n0; r < n1; r += 2) {                                                 \
        const int64_t r1 = r + 1 < n1 ? r + 1 : r;                                          \
        __m512 a0[BT], a1[BT];                                                              \
        for (int b = 0; b < BT; b++) a0[b] = a1[b] = _mm512_setzero_ps();                   \
        for (int64_t j = 0; j < nb; j++) {                                                  \
            __m512 w0lo, w0hi, w1lo, w1hi;                                                  \
            DEQUANT(r, w0lo, w0hi);                                                         \
            DEQUANT(r1, w1lo, w1hi);                                                        \
            const float *xj = xp + j * (BT * QK);                                           \
            for (int b = 0; b < BT; b++) {                                                  \
                const __m512 xl = _mm512_loadu_ps(xj + b * QK);                             \
                const __m512 xh = _mm512_loadu_ps(xj + b * QK + QK / 2);                    \
                a0[b] = _mm512_fmadd_ps(w0lo, xl, a0[b]);                                   \
                a0[b] = _mm512_fmadd_ps(w0hi, xh, a0[b]);                                   \
                a1[b] = _mm512_fmadd_ps(w1lo, xl, a1[b]);                                   \
                a1[b] = _mm512_fmadd_ps(w1hi, xh, a1[b]);                                   \
            }                                                                               \
        }                                                                                   \
        for (int b = 0; b < BT; b++) {                                                      \
            y[b * n + r] = _mm512_reduce_add_ps(a0[b]);                                     \
            if (r1 != r) y[b * n + r1] = _mm512_reduce_add_ps(a1[b]);                       \
        }                                                                                   \
    }

/* Q4_1: (d * q) + m, rounded twice, exactly as gguf-py dequantises. A nibble has 16
 * values, so the block's 16 possible weights are computed once (a multiply and an add
 * on 0..15) and each weight is looked up by its nibble (vpermps reads the low four
 * bits of each index lane): no int-to-float conversions, the same rounding. */
#define Q4_1_DEQUANT(row, lo, hi)                                                           \
    {                                                                                       \
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + ((row) * nb + j) * (QK / 2)))); \
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(_cvtsh_ss(d[(row) * nb + j]))), \
                                           _mm512_set1_ps(_cvtsh_ss(m[(row) * nb + j])));   \
        lo = _mm512_permutexvar_ps(q, table);                                               \
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);                         \
    }

/* Q8_0: d * q. */
#define Q8_0_DEQUANT(row, lo, hi)                                                           \
    {                                                                                       \
        const int8_t *q = qs + ((row) * nb + j) * QK;                                       \
        const __m512 dj = _mm512_set1_ps(_cvtsh_ss(d[(row) * nb + j]));                      \
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), dj); \
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), dj); \
    }

#define Q4_1_TILE(BT)                                                                       \
    TARGET_AVX512 static void q4_1_tile##BT(const float *xp, int64_t nb, const uint8_t *qs,   \
                                            const uint16_t *d, const uint16_t *m, int64_t n0,  \
                                            int64_t n1, float *y, int64_t n) {                 \
        const __m512 iota =                                                                    \
            _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);              \
        PAIR_TILE(BT, Q4_1_DEQUANT)                                                          \
    }
#define Q8_0_TILE(BT)                                                                       \
    TARGET_AVX512 static void q8_0_tile##BT(const float *xp, int64_t nb, const int8_t *qs,    \
                                            const uint16_t *d, int64_t n0, int64_t n1,         \
                                            float *y, int64_t n) {                             \
        PAIR_TILE(BT, Q8_0_DEQUANT)                                                          \
    }
Q4_1_TILE(8)
Q4_1_TILE(4)
Q4_1_TILE(2)
Q4_1_TILE(1)
Q8_0_TILE(8)
Q8_0_TILE(4)
Q8_0_TILE(2)
Q8_0_TILE(1)

/* Output rows [n0, n1) for every activation row, tile by tile (xp as pack_tiles
 * wrote it). */
static void q4_1_rows_avx512(const float *xp, int64_t rows, int64_t k, const uint8_t *qs,
                             const uint16_t *d, const uint16_t *m, int64_t n0, int64_t n1,
                             float *y, int64_t n) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const float *xt = xp + b0 * k;
        float *yt = y + b0 * n;
        switch (bt) {
        case 8: q4_1_tile8(xt, k / QK, qs, d, m, n0, n1, yt, n); break;
        case 4: q4_1_tile4(xt, k / QK, qs, d, m, n0, n1, yt, n); break;
        case 2: q4_1_tile2(xt, k / QK, qs, d, m, n0, n1, yt, n); break;
        default: q4_1_tile1(xt, k / QK, qs, d, m, n0, n1, yt, n);
        }
    }
}

static void q8_0_rows_avx512(const float *xp, int64_t rows, int64_t k, const int8_t *qs,
                             const uint16_t *d, int64_t n0, int64_t n1, float *y, int64_t n) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const float *xt = xp + b0 * k;
        float *yt = y + b0 * n;
        switch (bt) {
        case 8: q8_0_tile8(xt, k / QK, qs, d, n0, n1, yt, n); break;
        case 4: q8_0_tile4(xt, k / QK, qs, d, n0, n1, yt, n); break;
        case 2: q8_0_tile2(xt, k / QK, qs, d, n0, n1, yt, n); break;
        default: q8_0_tile1(xt, k / QK, qs, d, n0, n1, yt, n);
        }
    }
}

/* Blocks [i0, i1) of a weight back to float32 (the dequant functions below), with
 * the kernels' own dequantisation: (row) * nb + j is block j. */
TARGET_AVX512
static void q4_1_dequant_avx512(const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                                int64_t i0, int64_t i1, float *w) {
    const int64_t nb = 0;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = i0; j < i1; j++) {
        __m512 lo, hi;
        Q4_1_DEQUANT(0, lo, hi);
        _mm512_storeu_ps(w + j * QK, lo);
        _mm512_storeu_ps(w + j * QK + QK / 2, hi);
    }
}

TARGET_AVX512
static void q8_0_dequant_avx512(const int8_t *qs, const uint16_t *d, int64_t i0, int64_t i1,
                                float *w) {
    const int64_t nb = 0;
    for (int64_t j = i0; j < i1; j++) {
        __m512 lo, hi;
        Q8_0_DEQUANT(0, lo, hi);
        _mm512_storeu_ps(w + j * QK, lo);
        _mm512_storeu_ps(w + j * QK + QK / 2, hi);
    }
}
#endif

static int use_avx512(void) {
#if HAVE_X86 && !defined(OMNI_GENERIC_KERNELS) /* -DOMNI_GENERIC_KERNELS: test the portable path */
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
    }
    return cached;
#else
    return 0;
#endif
}

/* Rows per OpenMP chunk: small enough to balance two to a few dozen threads, big
 * enough that a chunk reads a few pages of weights. */
#define ROW_CHUNK 16
/* Blocks per OpenMP chunk of a dequantisation (128 KiB of float32 out). */
#define DEQUANT_CHUNK 1024

/* The activations packed into tiles for the AVX-512 path (NULL: use x as it is,
 * one row or the portable path; *failed when out of memory). */
static float *packed(const float *x, int64_t rows, int64_t k, int avx, int *failed) {
    *failed = 0;
    if (!avx || rows == 1) return NULL;
    float *xp = malloc((size_t)(rows * k) * sizeof(float));
    if (!xp) {
        *failed = 1;
        return NULL;
    }
    pack_tiles(x, rows, k, xp);
    return xp;
}

static int q4_1_linear(const float *x, int64_t rows, int64_t k, const uint8_t *qs,
                       const uint16_t *d, const uint16_t *m, int64_t n, float *y, int threads) {
    const int avx = use_avx512();
    int failed;
    float *xp = packed(x, rows, k, avx, &failed);
    if (failed) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < (n + ROW_CHUNK - 1) / ROW_CHUNK; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < n ? n0 + ROW_CHUNK : n;
#if HAVE_X86
        if (avx) {
            q4_1_rows_avx512(xp ? xp : x, rows, k, qs, d, m, n0, n1, y, n);
            continue;
        }
#endif
        q4_1_rows_generic(x, rows, k, qs, d, m, n0, n1, y, n);
    }
    free(xp);
    return 0;
}

static int q8_0_linear(const float *x, int64_t rows, int64_t k, const int8_t *qs,
                       const uint16_t *d, int64_t n, float *y, int threads) {
    const int avx = use_avx512();
    int failed;
    float *xp = packed(x, rows, k, avx, &failed);
    if (failed) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < (n + ROW_CHUNK - 1) / ROW_CHUNK; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < n ? n0 + ROW_CHUNK : n;
#if HAVE_X86
        if (avx) {
            q8_0_rows_avx512(xp ? xp : x, rows, k, qs, d, n0, n1, y, n);
            continue;
        }
#endif
        q8_0_rows_generic(x, rows, k, qs, d, n0, n1, y, n);
    }
    free(xp);
    return 0;
}

/* Whole weights back to float32, [n][k], for many-row products (a prefill), where
 * a float32 GEMM on the dequantised weight beats re-dequantising per row tile. The
 * same (d * q) + m, rounded twice, as gguf-py and the kernels above. */
static void q4_1_dequant(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t n,
                         int64_t k, float *w, int threads) {
    const int64_t blocks = n * (k / QK);
    const int avx = use_avx512();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < (blocks + DEQUANT_CHUNK - 1) / DEQUANT_CHUNK; c++) {
        const int64_t i0 = c * DEQUANT_CHUNK, i1 = i0 + DEQUANT_CHUNK < blocks ? i0 + DEQUANT_CHUNK : blocks;
#if HAVE_X86
        if (avx) {
            q4_1_dequant_avx512(qs, d, m, i0, i1, w);
            continue;
        }
#endif
        (void)avx;
        for (int64_t i = i0; i < i1; i++) {
            const uint8_t *q = qs + i * (QK / 2);
            float *o = w + i * QK;
            const float di = half_to_float(d[i]), mi = half_to_float(m[i]);
            for (int j = 0; j < QK / 2; j++) {
                o[j] = di * (float)(q[j] & 0x0F) + mi;
                o[j + QK / 2] = di * (float)(q[j] >> 4) + mi;
            }
        }
    }
}

static void q8_0_dequant(const int8_t *qs, const uint16_t *d, int64_t n, int64_t k, float *w,
                         int threads) {
    const int64_t blocks = n * (k / QK);
    const int avx = use_avx512();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < (blocks + DEQUANT_CHUNK - 1) / DEQUANT_CHUNK; c++) {
        const int64_t i0 = c * DEQUANT_CHUNK, i1 = i0 + DEQUANT_CHUNK < blocks ? i0 + DEQUANT_CHUNK : blocks;
#if HAVE_X86
        if (avx) {
            q8_0_dequant_avx512(qs, d, i0, i1, w);
            continue;
        }
#endif
        (void)avx;
        for (int64_t i = i0; i < i1; i++) {
            const float di = half_to_float(d[i]);
            for (int j = 0; j < QK; j++) w[i * QK + j] = di * (float)qs[i * QK + j];
        }
    }
}

/* ---------------------------------------------------------------- decode-step glue
 * The float32 operations between a layer's products (lean_forward.py), each one call
 * instead of five to a dozen torch ops of a few microseconds of dispatch each, with
 * torch's float32 rounding up to the order of a sum (-ffp-contract=off keeps each
 * product and sum rounded as torch rounds it; rotary is bit for bit). The exp of
 * SiLU and of the softmax is libm's expf on the portable path and a vectorised
 * polynomial (Cephes' expf, about 1 ulp) on AVX-512, where the dot products of the
 * attention are AVX-512 too. A decode step has 1 to a few dozen rows, so threads
 * split rows (or rows and heads) only from GLUE_PARALLEL floats of work: below it a
 * parallel region costs more than it saves (measured on SmolLM2's widths, 2 threads). */

#define GLUE_PARALLEL 16384
#define LANES 16

/* A float32 dot product over LANES partial sums, added pairwise at the end. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0}, tail = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[i + l] * b[i + l];
    for (; i < n; i++) tail += a[i] * b[i];
    for (int width = LANES / 2; width; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    return part[0] + tail;
}

#if HAVE_X86
/* exp(x): x = n ln2 + r, |r| <= ln2 / 2; exp(r) by Cephes' expf polynomial; times 2^n
 * (scalef). Clamped where float32's exp overflows or is zero anyway. */
TARGET_AVX512 static inline __m512 exp512(__m512 x) {
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

TARGET_AVX512 static void silu_row_avx512(const float *g, const float *u, float *o, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 gi = _mm512_maskz_loadu_ps(in, g + i), ui = _mm512_maskz_loadu_ps(in, u + i);
        const __m512 silu = _mm512_div_ps(gi, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, gi))));
        _mm512_mask_storeu_ps(o + i, in, _mm512_mul_ps(silu, ui));
    }
}

/* One (row, head) of attend_one for dim a multiple of 16, up to 256. */
TARGET_AVX512 static void attend_head_avx512(const float *qv, const float *k, const float *v,
                                             const uint8_t *seen, int64_t columns, int64_t dim,
                                             float scale, float *p, float *o) {
    const int64_t vecs = dim / 16;
    __m512 acc[16], qr[16];
    for (int64_t c = 0; c < vecs; c++) qr[c] = _mm512_loadu_ps(qv + 16 * c);
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
        const __mmask16 in = columns - j >= 16 ? 0xFFFF : (__mmask16)((1u << (columns - j)) - 1);
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
#endif

/* h += delta (when delta), then out = weight * (h * rsqrt(mean(h^2) + eps)): the
 * residual add and the next RMSNorm (Llama's: float32, weight times the normalised
 * value) in one pass over the row. out may be h. */
static void add_rms_norm(float *h, const float *delta, int64_t rows, int64_t n,
                         const float *weight, float eps, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * n, *o = out + r * n;
        if (delta)
            for (int64_t i = 0; i < n; i++) hr[i] += delta[r * n + i];
        const float scale = 1.0f / sqrtf(dot(hr, hr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (hr[i] * scale);
    }
}

/* out[r][i] = silu(g) * u for gate_up [rows][2 * inter] = [gate | up]: silu(g) =
 * g / (1 + exp(-g)), as torch computes it. */
static void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out, int threads) {
    const int avx = use_avx512();
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
#if HAVE_X86
        if (avx) {
            silu_row_avx512(g, u, o, inter);
            continue;
        }
#endif
        (void)avx;
        for (int64_t i = 0; i < inter; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* Rotary embeddings in place on the first `heads` heads of each row of x [rows][width]
 * (a fused qkv output: q's heads, then k's, then v's, which are left alone), with cos,
 * sin [rows][dim]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], the same
 * products and sums as transformers' apply_rotary_pos_emb, so bit for bit its result. */
static void rotary(float *x, int64_t rows, int64_t width, int64_t heads, int64_t dim,
                   const float *cos, const float *sin, int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * dim >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *x1 = x + r * width + hd * dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] + (-b) * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* Attention of one query per row against that row's keys and values: out[r][h] =
 * softmax(q k^T * scale) v over the row's `columns` keys (those whose byte in the
 * row's mask [rows][mask_row] is set, where a mask is given), query head h
 * reading kv head h / (heads / kv_heads) (grouped-query, nothing repeated). Float32
 * throughout, the softmax with its maximum subtracted. Strides are in floats:
 * q [rows][heads][dim] (q_row, q_head), keys and values [rows][kv_heads][columns][dim]
 * (kv_row, kv_head, column stride dim); out [rows][heads][dim], contiguous. */
static int attend_one(const float *q, int64_t q_row, int64_t q_head, const float *keys,
                      const float *values, int64_t kv_row, int64_t kv_head, const uint8_t *mask,
                      int64_t mask_row, int64_t rows, int64_t heads, int64_t kv_heads,
                      int64_t columns, int64_t dim, float scale, float *out, int threads) {
    const int64_t group = heads / kv_heads, work = rows * heads * columns * dim;
    const int avx = use_avx512() && dim % 16 == 0 && dim <= 256;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (work >= 4 * GLUE_PARALLEL)
    {
        float *p = malloc((size_t)(columns + 16) * sizeof(float));
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows * heads; rh++) {
            if (!p) continue;
            const int64_t r = rh / heads, hd = rh % heads;
            const float *qv = q + r * q_row + hd * q_head;
            const float *k = keys + r * kv_row + (hd / group) * kv_head;
            const float *v = values + r * kv_row + (hd / group) * kv_head;
            const uint8_t *seen = mask ? mask + r * mask_row : NULL;
            float *o = out + rh * dim, top = -INFINITY;
#if HAVE_X86
            if (avx) {
                attend_head_avx512(qv, k, v, seen, columns, dim, scale, p, o);
                continue;
            }
#endif
            for (int64_t j = 0; j < columns; j++) {
                p[j] = seen && !seen[j] ? -INFINITY : dot(qv, k + j * dim, dim) * scale;
                top = p[j] > top ? p[j] : top;
            }
            float total = 0.0f;
            for (int64_t j = 0; j < columns; j++) total += (p[j] = expf(p[j] - top));
            for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
            for (int64_t j = 0; j < columns; j++)
                for (int64_t i = 0; i < dim; i++) o[i] += p[j] * v[j * dim + i];
            const float inv = 1.0f / total;
            for (int64_t i = 0; i < dim; i++) o[i] *= inv;
        }
        free(p);
    }
    return !failed;
}

/* ---------------------------------------------------------------- Python glue
 * Pointers come in as integers (torch's data_ptr()); the Python wrapper
 * (block_linear.py) checks dtypes, shapes and contiguity before calling. */

static int check_shape(long long rows, long long k, long long n, int threads) {
    if (rows < 0 || n < 0 || k <= 0 || k % QK || threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "k must be a positive multiple of 32, rows and n >= 0, threads >= 1");
        return 0;
    }
    return 1;
}

static PyObject *py_q4_1_linear(PyObject *self, PyObject *args) {
    unsigned long long x, qs, d, m, y;
    long long rows, k, n;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKKKLKi", &x, &rows, &k, &qs, &d, &m, &n, &y, &threads))
        return NULL;
    if (!check_shape(rows, k, n, threads)) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = q4_1_linear((const float *)x, rows, k, (const uint8_t *)qs, (const uint16_t *)d,
                         (const uint16_t *)m, n, (float *)y, threads);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_q8_0_linear(PyObject *self, PyObject *args) {
    unsigned long long x, qs, d, y;
    long long rows, k, n;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKKLKi", &x, &rows, &k, &qs, &d, &n, &y, &threads))
        return NULL;
    if (!check_shape(rows, k, n, threads)) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = q8_0_linear((const float *)x, rows, k, (const int8_t *)qs, (const uint16_t *)d, n,
                         (float *)y, threads);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_q4_1_dequant(PyObject *self, PyObject *args) {
    unsigned long long qs, d, m, w;
    long long n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKLLKi", &qs, &d, &m, &n, &k, &w, &threads)) return NULL;
    if (!check_shape(0, k, n, threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    q4_1_dequant((const uint8_t *)qs, (const uint16_t *)d, (const uint16_t *)m, n, k, (float *)w,
                 threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_q8_0_dequant(PyObject *self, PyObject *args) {
    unsigned long long qs, d, w;
    long long n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKi", &qs, &d, &n, &k, &w, &threads)) return NULL;
    if (!check_shape(0, k, n, threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    q8_0_dequant((const int8_t *)qs, (const uint16_t *)d, n, k, (float *)w, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long h, delta, weight, out;
    long long rows, n;
    float eps;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKfKi", &h, &delta, &rows, &n, &weight, &eps, &out, &threads))
        return NULL;
    if (rows < 0 || n <= 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rows >= 0, n >= 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    add_rms_norm((float *)h, (const float *)delta, rows, n, (const float *)weight, eps,
                 (float *)out, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    unsigned long long gate_up, out;
    long long rows, inter;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKi", &gate_up, &rows, &inter, &out, &threads)) return NULL;
    if (rows < 0 || inter <= 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rows >= 0, inter >= 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul((const float *)gate_up, rows, inter, (float *)out, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rotary(PyObject *self, PyObject *args) {
    unsigned long long x, cos, sin;
    long long rows, width, heads, dim;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLLLKKi", &x, &rows, &width, &heads, &dim, &cos, &sin, &threads))
        return NULL;
    if (rows < 0 || dim <= 0 || dim % 2 || heads < 0 || heads * dim > width || threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "dim must be even and positive, heads * dim <= width, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rotary((float *)x, rows, width, heads, dim, (const float *)cos, (const float *)sin, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_attend_one(PyObject *self, PyObject *args) {
    unsigned long long q, keys, values, mask, out;
    long long q_row, q_head, kv_row, kv_head, mask_row, rows, heads, kv_heads, columns, dim;
    float scale;
    int threads, ok;
    if (!PyArg_ParseTuple(args, "KLLKKLLKLLLLLLfKi", &q, &q_row, &q_head, &keys, &values, &kv_row,
                          &kv_head, &mask, &mask_row, &rows, &heads, &kv_heads, &columns, &dim,
                          &scale, &out, &threads))
        return NULL;
    if (rows < 0 || kv_heads <= 0 || heads % kv_heads || columns <= 0 || dim <= 0 ||
        threads < 1) {
        PyErr_SetString(PyExc_ValueError, "heads a multiple of kv_heads >= 1, columns and dim "
                                          ">= 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ok = attend_one((const float *)q, q_row, q_head, (const float *)keys, (const float *)values,
                    kv_row, kv_head, (const uint8_t *)mask, mask_row, rows, heads, kv_heads,
                    columns, dim, scale, (float *)out, threads);
    Py_END_ALLOW_THREADS
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(use_avx512() ? "avx512" : "generic");
}

static PyMethodDef methods[] = {
    {"q4_1_linear", py_q4_1_linear, METH_VARARGS,
     "q4_1_linear(x, rows, k, qs, d, m, n, y, threads): y[rows][n] = x[rows][k] @ W.T, W in Q4_1 blocks"},
    {"q8_0_linear", py_q8_0_linear, METH_VARARGS,
     "q8_0_linear(x, rows, k, qs, d, n, y, threads): y[rows][n] = x[rows][k] @ W.T, W in Q8_0 blocks"},
    {"q4_1_dequant", py_q4_1_dequant, METH_VARARGS,
     "q4_1_dequant(qs, d, m, n, k, w, threads): W[n][k] as float32 into w"},
    {"q8_0_dequant", py_q8_0_dequant, METH_VARARGS,
     "q8_0_dequant(qs, d, n, k, w, threads): W[n][k] as float32 into w"},
    {"simd", py_simd, METH_NOARGS, "The code path this CPU runs: 'avx512' or 'generic'."},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS,
     "add_rms_norm(h, delta, rows, n, weight, eps, out, threads): h += delta (delta 0: none), "
     "out = weight * h * rsqrt(mean(h^2) + eps)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(gate_up, rows, inter, out, threads): out = silu(gate) * up"},
    {"rotary", py_rotary, METH_VARARGS,
     "rotary(x, rows, width, heads, dim, cos, sin, threads): rotary embeddings in place"},
    {"attend_one", py_attend_one, METH_VARARGS,
     "attend_one(q, q_row, q_head, keys, values, kv_row, kv_head, mask, mask_row, rows, heads, "
     "kv_heads, columns, dim, scale, out, threads): one query per row (mask 0: none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_block_kernels", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__block_kernels(void) { return PyModule_Create(&module); }
