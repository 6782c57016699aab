/* Shared by the C extension's files: _block_products.c (GGUF block products),
 * _decode_glue.c (the float32 operations between them), _decode_stack.c (a decode
 * step's whole layer stack in one call) and _block_kernels.c (the Python module). */
#ifndef OMNI_KERNELS_H
#define OMNI_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
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
}


/* Whether the AVX-512 paths run on this CPU (and this build). */
int use_avx512(void);

/* One weight in GGUF blocks (layout in _block_products.c); bias [n] or NULL. The
 * Python side mirrors this struct with ctypes (decode_stack.py). */
enum { BLOCK_Q4_1 = 0, BLOCK_Q8_0 = 1 };
typedef struct {
    int64_t kind;
    const void *qs;
    const uint16_t *d, *m; /* m: Q4_1's mins, NULL for Q8_0 */
    int64_t n, k;
    const float *bias;
} BlockWeight;

/* _block_products.c: y [rows][n] = x [rows][k] @ W.T, W in blocks; 0, or -1 when out
 * of memory. The dequantisations write W [n][k] as float32. */
int q4_1_linear(const float *x, int64_t rows, int64_t k, const uint8_t *qs, const uint16_t *d,
                const uint16_t *m, int64_t n, float *y, int threads);
int q8_0_linear(const float *x, int64_t rows, int64_t k, const int8_t *qs, const uint16_t *d,
                int64_t n, float *y, int threads);
void q4_1_dequant(const uint8_t *qs, const uint16_t *d, const uint16_t *m, int64_t n, int64_t k,
                  float *w, int threads);
void q8_0_dequant(const int8_t *qs, const uint16_t *d, int64_t n, int64_t k, float *w,
                  int threads);
/* The same products from inside a parallel region: x [rows][k] packed into tiles
 * (pack_tiles writes tiled_rows(rows) * k floats; only where tiles_wanted, else x as
 * it is), the
 * output rows shared out over the region's threads by an orphaned omp for (with its
 * barrier at the end). The bias is not added. */
int64_t tiled_rows(int64_t rows);
void pack_tiles(const float *x, int64_t rows, int64_t k, float *xp);
int tiles_wanted(int64_t rows, int avx); /* whether the products read packed tiles */
void block_product_for(const BlockWeight *w, const float *x, int64_t rows, float *y, int avx);

/* _decode_glue.c */
void add_rms_norm(float *h, const float *delta, int64_t rows, int64_t n,
                         const float *weight, float eps, float *out, int threads);
void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out, int threads);
void rotary(float *x, int64_t rows, int64_t width, int64_t heads, int64_t dim,
                   const float *cos, const float *sin, int threads);
int attend_one(const float *q, int64_t q_row, int64_t q_head, const float *keys,
                      const float *values, int64_t kv_row, int64_t kv_head, const uint8_t *mask,
                      int64_t mask_row, int64_t rows, int64_t heads, int64_t kv_heads,
                      int64_t columns, int64_t dim, float scale, float *out, int threads);
/* One row (or one row's head) of the above, for _decode_stack.c: the same arithmetic. */
void rms_norm_row(float *h, const float *delta, int64_t n, const float *weight, float eps,
                  float *out);
void silu_row(const float *g, const float *u, float *o, int64_t n, int avx);
void rotary_row(float *x, int64_t heads, int64_t dim, const float *cos, const float *sin);
int attend_avx512(int64_t dim); /* whether attend_head takes its AVX-512 path for dim */
void attend_head(const float *qv, const float *k, const float *v, const uint8_t *seen,
                 int64_t columns, int64_t dim, float scale, float *p, float *o, int avx);

/* _decode_stack.c: one layer of a Llama-shaped decoder, as lean_forward.py runs it. */
typedef struct {
    const float *norm_in, *norm_post; /* RMSNorm weights [size] */
    float eps_in, eps_post, scale;    /* the norms' epsilons, attention's scale */
    BlockWeight qkv, o, gate_up, down;
} StackLayer;
/* Where each layer's keys and values go: [rows][kv_heads][room][dim] buffers, row
 * and head strides in floats. */
typedef struct {
    float *keys, *values;
    int64_t row, head;
} StackCache;
int decode_stack(const StackLayer *layers, const StackCache *caches, int64_t count, float *h,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const float *cos,
                 const float *sin, const uint8_t *mask, int64_t column, const float *norm,
                 float eps, float *states, int threads);

#endif
