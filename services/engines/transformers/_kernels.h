/* Shared by the C extension's files: _block_products.c (GGUF block products),
 * _decode_glue.c (the float32 operations between them) and _block_kernels.c (the
 * Python module). */
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
} /* activation rows per pass over a weight row */


/* Whether the AVX-512 paths run on this CPU (and this build). */
int use_avx512(void);

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

#endif
