/* The decode step's glue.
 *
 * The float32 operations between a layer's products (lean_forward.py), each one call
 * instead of five to a dozen torch ops of a few microseconds of dispatch each, with
 * torch's float32 rounding up to the order of a sum (-ffp-contract=off keeps each
 * product and sum rounded as torch rounds it; rotary is bit for bit). The exp of
 * SiLU and of the softmax is libm's expf on the portable path and a vectorised
 * polynomial (Cephes' expf, about 1 ulp) on AVX-512, where the dot products of the
 * attention are AVX-512 too. A decode step has 1 to a few dozen rows, so threads
 * split rows (or rows and heads) only from GLUE_PARALLEL floats of work: below it a
 * parallel region costs more than it saves (measured on SmolLM2's widths, 2 threads). */

#include "_kernels.h"

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
void rms_norm_row(float *h, const float *delta, int64_t n, const float *weight, float eps,
                  float *out) {
    if (delta)
        for (int64_t i = 0; i < n; i++) h[i] += delta[i];
    const float scale = 1.0f / sqrtf(dot(h, h, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (h[i] * scale);
}

void add_rms_norm(float *h, const float *delta, int64_t rows, int64_t n,
                  const float *weight, float eps, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(h + r * n, delta ? delta + r * n : NULL, n, weight, eps, out + r * n);
}

/* o[i] = silu(g[i]) * u[i], silu(g) = g / (1 + exp(-g)), as torch computes it. */
void silu_row(const float *g, const float *u, float *o, int64_t n, int avx) {
#if HAVE_X86
    if (avx) {
        silu_row_avx512(g, u, o, n);
        return;
    }
#endif
    (void)avx;
    for (int64_t i = 0; i < n; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

/* out[r] = silu(gate) * up for gate_up [rows][2 * inter] = [gate | up]. */
void silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out, int threads) {
    const int avx = use_avx512();
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter,
                 avx);
}

/* Rotary embeddings in place on the first `heads` heads of one row x (a fused qkv
 * output: q's heads, then k's, then v's, which are left alone), with cos, sin [dim]:
 * x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], the same products and
 * sums as transformers' apply_rotary_pos_emb, so bit for bit its result. */
void rotary_row(float *x, int64_t heads, int64_t dim, const float *c, const float *s) {
    const int64_t half = dim / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        float *x1 = x + hd * dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] + (-b) * s[i];
            x2[i] = b * c[half + i] + a * s[half + i];
        }
    }
}

/* rotary_row over each row of x [rows][width], cos and sin [rows][dim]. */
void rotary(float *x, int64_t rows, int64_t width, int64_t heads, int64_t dim,
            const float *cos, const float *sin, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * dim >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++) rotary_row(x + r * width, heads, dim, cos + r * dim, sin + r * dim);
}

int attend_avx512(int64_t dim) { return use_avx512() && dim % 16 == 0 && dim <= 256; }

/* softmax(q k^T * scale) v for one query qv [dim] against `columns` keys k and values
 * v [columns][dim] (those whose byte in `seen` is set, where given): float32
 * throughout, the softmax with its maximum subtracted; p is scratch for columns + 16
 * floats, o [dim] the result. */
void attend_head(const float *qv, const float *k, const float *v, const uint8_t *seen,
                 int64_t columns, int64_t dim, float scale, float *p, float *o, int avx) {
#if HAVE_X86
    if (avx) {
        attend_head_avx512(qv, k, v, seen, columns, dim, scale, p, o);
        return;
    }
#endif
    (void)avx;
    float top = -INFINITY;
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

/* Attention of one query per row against that row's keys and values: out[r][h] =
 * attend_head over the row's `columns` keys (those whose byte in the row's mask
 * [rows][mask_row] is set, where a mask is given), query head h reading kv head
 * h / (heads / kv_heads) (grouped-query, nothing repeated). Strides are in floats:
 * q [rows][heads][dim] (q_row, q_head), keys and values [rows][kv_heads][columns][dim]
 * (kv_row, kv_head, column stride dim); out [rows][heads][dim], contiguous. */
int attend_one(const float *q, int64_t q_row, int64_t q_head, const float *keys,
               const float *values, int64_t kv_row, int64_t kv_head, const uint8_t *mask,
               int64_t mask_row, int64_t rows, int64_t heads, int64_t kv_heads,
               int64_t columns, int64_t dim, float scale, float *out, int threads) {
    const int64_t group = heads / kv_heads, work = rows * heads * columns * dim;
    const int avx = attend_avx512(dim);
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
            attend_head(q + r * q_row + hd * q_head, keys + r * kv_row + (hd / group) * kv_head,
                        values + r * kv_row + (hd / group) * kv_head,
                        mask ? mask + r * mask_row : NULL, columns, dim, scale, p, out + rh * dim,
                        avx);
        }
        free(p);
    }
    return !failed;
}
