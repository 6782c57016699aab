/* A decode step's whole layer stack in one call.
 *
 * lean_forward.py runs a layer as about ten calls (four products, the glue between
 * them, attention, the cache write), each with its Python wrapper and its own OpenMP
 * parallel region: at SmolLM2's size that dispatch was about 40 % of a batch-1 decode
 * step (11.7 ms in-process against 6.8 ms for the products alone). Here every layer
 * runs inside one parallel region, the threads meeting at a barrier between the
 * operations (each omp for or single ends with one), the way llama.cpp's graph runs
 * on its thread pool.
 *
 * It computes what the lean forward's C glue path computes, bit for bit: the same
 * row functions (_decode_glue.c) and products (_block_products.c), in the same order.
 * Threads only share out rows, heads and output columns, which changes no sum.
 *
 * One step: each of `rows` sequences brings one new token. h [rows][size] holds its
 * embedding and is the residual stream, added into in place; the new keys and values
 * are written at column `column` of each layer's cache, and attention reads columns
 * 0..column (those set in mask [rows][column + 1], where a mask is given). states
 * [rows][size] receives the final norm's output. */
#include "_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
#endif

static float *floats(int64_t count) {
    return aligned_alloc(64, ((size_t)count * sizeof(float) + 63) & ~(size_t)63);
}

/* y = w x (+ bias), inside the parallel region: the activations packed by one thread
 * where the tiles are wanted, the output rows shared out, the bias added by rows. */
static void product(const BlockWeight *w, const float *x, int64_t rows, float *xp, float *y,
                    int avx) {
    const int tiles = tiles_wanted(rows, avx);
    if (tiles) {
#pragma omp single
        pack_tiles(x, rows, w->k, xp);
    }
    block_product_for(w, tiles ? xp : x, rows, y, avx);
    if (w->bias) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < w->n; i++) y[r * w->n + i] += w->bias[i];
    }
}

int decode_stack(const StackLayer *layers, const StackCache *caches, int64_t count, float *h,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const float *cos,
                 const float *sin, const uint8_t *mask, int64_t column, const float *norm,
                 float eps, float *states, int threads) {
    const int64_t size = layers[0].qkv.k, width = layers[0].qkv.n;
    const int64_t inter = layers[0].down.k, group = heads / kv_heads, columns = column + 1;
    int64_t widest = size > inter ? size : inter;
    widest = widest > heads * dim ? widest : heads * dim;
    const int avx = use_avx512(), avx_attend = attend_avx512(dim);
    float *x = floats(rows * size), *xp = floats(tiled_rows(rows) * widest), *qkv = floats(rows * width);
    float *att = floats(rows * heads * dim), *delta = floats(rows * size);
    float *gate_up = floats(rows * 2 * inter), *act = floats(rows * inter);
    float *scores = floats((int64_t)threads * (columns + 16));
    int failed = !x || !xp || !qkv || !att || !delta || !gate_up || !act || !scores;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *p = scores + (int64_t)omp_get_thread_num() * (columns + 16);
            for (int64_t l = 0; l < count; l++) {
                const StackLayer *L = layers + l;
                const StackCache *C = caches + l;
                /* the previous layer's MLP output into the residual, the input norm */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++)
                    rms_norm_row(h + r * size, l ? delta + r * size : NULL, size, L->norm_in,
                                 L->eps_in, x + r * size);
                product(&L->qkv, x, rows, xp, qkv, avx);
                /* rotary on q's and k's heads; k and v into the cache */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++) {
                    float *row = qkv + r * width;
                    rotary_row(row, heads + kv_heads, dim, cos + r * dim, sin + r * dim);
                    for (int64_t kh = 0; kh < kv_heads; kh++) {
                        const int64_t at = r * C->row + kh * C->head + column * dim;
                        memcpy(C->keys + at, row + (heads + kh) * dim, dim * sizeof(float));
                        memcpy(C->values + at, row + (heads + kv_heads + kh) * dim,
                               dim * sizeof(float));
                    }
                }
#pragma omp for schedule(static)
                for (int64_t rh = 0; rh < rows * heads; rh++) {
                    const int64_t r = rh / heads, hd = rh % heads;
                    const int64_t at = r * C->row + (hd / group) * C->head;
                    attend_head(qkv + r * width + hd * dim, C->keys + at, C->values + at,
                                mask ? mask + r * columns : NULL, columns, dim, L->scale, p,
                                att + rh * dim, avx_attend);
                }
                product(&L->o, att, rows, xp, delta, avx);
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++)
                    rms_norm_row(h + r * size, delta + r * size, size, L->norm_post,
                                 L->eps_post, x + r * size);
                product(&L->gate_up, x, rows, xp, gate_up, avx);
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++)
                    silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter,
                             act + r * inter, inter, avx);
                product(&L->down, act, rows, xp, delta, avx);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                rms_norm_row(h + r * size, delta + r * size, size, norm, eps, states + r * size);
        }
    }
    free(x), free(xp), free(qkv), free(att), free(delta), free(gate_up), free(act), free(scores);
    return failed ? -1 : 0;
}
