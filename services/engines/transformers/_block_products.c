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
#include "_kernels.h"

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

/* Activation rows are taken in tiles of 8; what is left, in one tile of 8, 4, 2 or 1
 * padded with zero rows (5 to 7 rows: 8; 3: 4). Each tile dequantises every weight
 * block again, so 7 rows as 4 + 2 + 1 cost a quarter more than 8 (measured in a
 * stage, a decode step of 7 rows took 26.7 ms where 8 took 21.4); a padded row costs
 * only its FMAs. A row's sum does not depend on its tile. */
static inline int64_t tile_width(int64_t left) {
    return left >= 5 ? 8 : left >= 3 ? 4 : left;
}

int64_t tiled_rows(int64_t rows) {
    return rows / ROW_TILE * ROW_TILE + (rows % ROW_TILE ? tile_width(rows % ROW_TILE) : 0);
}

/* x [rows][k] into tiles: tile by tile, each [k/32][its rows][32], padding rows zero;
 * xp holds tiled_rows(rows) * k floats. */
void pack_tiles(const float *x, int64_t rows, int64_t k, float *xp) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        float *tile = xp + b0 * k;
        for (int64_t j = 0; j < k / QK; j++)
            for (int64_t b = 0; b < bt; b++) {
                float *to = tile + (j * bt + b) * QK;
                if (b < real)
                    memcpy(to, x + (b0 + b) * k + j * QK, QK * sizeof(float));
                else
                    memset(to, 0, QK * sizeof(float));
            }
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
        for (int b = 0; b < real; b++) { /* a padded tile's real rows */                    \
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
                                            int64_t n1, float *y, int64_t n, int64_t real) {   \
        const __m512 iota =                                                                    \
            _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);              \
        PAIR_TILE(BT, Q4_1_DEQUANT)                                                          \
    }
#define Q8_0_TILE(BT)                                                                       \
    TARGET_AVX512 static void q8_0_tile##BT(const float *xp, int64_t nb, const int8_t *qs,    \
                                            const uint16_t *d, int64_t n0, int64_t n1,         \
                                            float *y, int64_t n, int64_t real) {               \
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
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        const float *xt = xp + b0 * k;
        float *yt = y + b0 * n;
        switch (bt) {
        case 8: q4_1_tile8(xt, k / QK, qs, d, m, n0, n1, yt, n, real); break;
        case 4: q4_1_tile4(xt, k / QK, qs, d, m, n0, n1, yt, n, real); break;
        case 2: q4_1_tile2(xt, k / QK, qs, d, m, n0, n1, yt, n, real); break;
        default: q4_1_tile1(xt, k / QK, qs, d, m, n0, n1, yt, n, real);
        }
    }
}

static void q8_0_rows_avx512(const float *xp, int64_t rows, int64_t k, const int8_t *qs,
                             const uint16_t *d, int64_t n0, int64_t n1, float *y, int64_t n) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        const float *xt = xp + b0 * k;
        float *yt = y + b0 * n;
        switch (bt) {
        case 8: q8_0_tile8(xt, k / QK, qs, d, n0, n1, yt, n, real); break;
        case 4: q8_0_tile4(xt, k / QK, qs, d, n0, n1, yt, n, real); break;
        case 2: q8_0_tile2(xt, k / QK, qs, d, n0, n1, yt, n, real); break;
        default: q8_0_tile1(xt, k / QK, qs, d, n0, n1, yt, n, real);
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

int use_avx512(void) {
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

int tiles_wanted(int64_t rows, int avx) { return avx && rows > 1; }

void block_product_for(const BlockWeight *w, const float *x, int64_t rows, float *y, int avx) {
    const int64_t n = w->n, k = w->k;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (n + ROW_CHUNK - 1) / ROW_CHUNK; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < n ? n0 + ROW_CHUNK : n;
        if (w->kind == BLOCK_Q4_1) {
#if HAVE_X86
            if (avx) {
                q4_1_rows_avx512(x, rows, k, w->qs, w->d, w->m, n0, n1, y, n);
                continue;
            }
#endif
            q4_1_rows_generic(x, rows, k, w->qs, w->d, w->m, n0, n1, y, n);
        } else {
#if HAVE_X86
            if (avx) {
                q8_0_rows_avx512(x, rows, k, w->qs, w->d, n0, n1, y, n);
                continue;
            }
#endif
            q8_0_rows_generic(x, rows, k, w->qs, w->d, n0, n1, y, n);
        }
    }
}

/* One product in its own parallel region: packs the activations where the tiles are
 * wanted (64-byte aligned: a 512-bit load never straddles two cache lines). */
static int block_linear(const BlockWeight *w, const float *x, int64_t rows, float *y,
                        int threads) {
    const int avx = use_avx512();
    float *xp = NULL;
    if (tiles_wanted(rows, avx)) {
        xp = aligned_alloc(64, ((size_t)(tiled_rows(rows) * w->k) * sizeof(float) + 63) & ~(size_t)63);
        if (!xp) return -1;
        pack_tiles(x, rows, w->k, xp);
    }
#pragma omp parallel num_threads(threads)
    block_product_for(w, xp ? xp : x, rows, y, avx);
    free(xp);
    return 0;
}

int q4_1_linear(const float *x, int64_t rows, int64_t k, const uint8_t *qs, const uint16_t *d,
                const uint16_t *m, int64_t n, float *y, int threads) {
    const BlockWeight w = {BLOCK_Q4_1, qs, d, m, n, k, NULL};
    return block_linear(&w, x, rows, y, threads);
}

int q8_0_linear(const float *x, int64_t rows, int64_t k, const int8_t *qs, const uint16_t *d,
                int64_t n, float *y, int threads) {
    const BlockWeight w = {BLOCK_Q8_0, qs, d, NULL, n, k, NULL};
    return block_linear(&w, x, rows, y, threads);
}

/* Whole weights back to float32, [n][k], for many-row products (a prefill), where
 * a float32 GEMM on the dequantised weight beats re-dequantising per row tile. The
 * same (d * q) + m, rounded twice, as gguf-py and the kernels above. */
void q4_1_dequant(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t n,
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

void q8_0_dequant(const int8_t *qs, const uint16_t *d, int64_t n, int64_t k, float *w,
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
