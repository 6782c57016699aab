/* A decode step's whole layer stack in one call; or, as a `sequence`, a prompt's
 * positions of one cache row (a prefill), each row of h one position.
 *
 * Run as separate calls, a layer is about ten (four products, the glue between them,
 * attention, the cache write), each with its Python dispatch and its own OpenMP
 * region: on SmolLM2-135M that was a large part of a batch-1 decode step beside the
 * products alone. Here every layer runs inside one parallel region, the threads
 * meeting at a barrier between the operations (each a spinning SpinBarrier,
 * kernels.h), the way llama.cpp's graph runs on its pool (figures: docs/benchmarks.md).
 *
 * It computes what the separate ops compute, bit for bit (the same row functions and
 * products, in the same order; threads only share out rows, heads and output rows),
 * which the tests assert. */
#include <initializer_list>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num() { return 0; }
static int omp_get_num_threads() { return 1; }
#endif

namespace omni {

int decode_stack(const Variant &v, const StackLayer *layers, const StackShape &shape, float *h,
                 int64_t rows, const float *cos, const float *sin, float *keys, float *values,
                 int64_t layer_stride, int64_t row_stride, int64_t head_stride,
                 const uint8_t *mask, int64_t column, const float *norm, float eps,
                 float *states, bool int8, bool sequence, int threads) {
    const int64_t heads = shape.heads, kv_heads = shape.kv_heads, dim = shape.dim;
    const int64_t size = shape.size, inter = shape.inter, group = heads / kv_heads;
    const int64_t width = (heads + 2 * kv_heads) * dim;
    /* the widest any row attends; a sequence's row r sees columns 0..column + r */
    const int64_t columns = column + (sequence ? rows : 1);
    /* where row r's keys and values sit in a layer's cache, before the head's offset:
     * its own cache row at `column`, or a sequence's one row at column + r */
    const auto kv_at = [&](int64_t r) {
        return sequence ? (column + r) * dim : r * row_stride + column * dim;
    };
    const auto kv_row = [&](int64_t r) { return sequence ? int64_t{0} : r * row_stride; };
    int64_t widest = size > inter ? size : inter;
    widest = widest > heads * dim ? widest : heads * dim;
    float *x = aligned_floats(rows * size), *xp = aligned_floats(tiled_rows(rows) * widest);
    float *qkv = aligned_floats(rows * width), *att = aligned_floats(rows * heads * dim);
    float *delta = aligned_floats(rows * size), *gate_up = aligned_floats(rows * 2 * inter);
    float *act = aligned_floats(rows * inter);
    float *scores = aligned_floats(static_cast<int64_t>(threads) * (columns + 16));
    const bool failed = !x || !xp || !qkv || !att || !delta || !gate_up || !act || !scores;
    SpinBarrier barrier;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp single
            barrier.team = omp_get_num_threads();  /* the team it got (implicit barrier) */
            float *p = scores + static_cast<int64_t>(omp_get_thread_num()) * (columns + 16);
            for (int64_t l = 0; l < shape.layers; l++) {
                const StackLayer &L = layers[l];
                float *lk = keys + l * layer_stride, *lv = values + l * layer_stride;
                /* the previous layer's MLP output into the residual, the input norm */
#pragma omp for schedule(static) nowait
                for (int64_t r = 0; r < rows; r++)
                    rms_norm_row(h + r * size, l ? delta + r * size : nullptr, size, L.norm_in,
                                 L.eps_in, x + r * size);
                barrier.wait();
                product_for(v, L.qkv, x, rows, xp, qkv, int8, barrier);
                /* per-head norms (Qwen3), rotary on q's and k's heads, k and v cached */
#pragma omp for schedule(static) nowait
                for (int64_t r = 0; r < rows; r++) {
                    float *row = qkv + r * width;
                    if (L.q_norm)
                        for (int64_t hd = 0; hd < heads; hd++)
                            rms_norm_row(row + hd * dim, nullptr, dim, L.q_norm, L.eps_head,
                                         row + hd * dim);
                    if (L.k_norm)
                        for (int64_t hd = heads; hd < heads + kv_heads; hd++)
                            rms_norm_row(row + hd * dim, nullptr, dim, L.k_norm, L.eps_head,
                                         row + hd * dim);
                    rotary_row(row, heads + kv_heads, dim, cos + r * dim, sin + r * dim);
                    for (int64_t kh = 0; kh < kv_heads; kh++) {
                        const int64_t at = kv_at(r) + kh * head_stride;
                        std::memcpy(lk + at, row + (heads + kh) * dim, dim * sizeof(float));
                        std::memcpy(lv + at, row + (heads + kv_heads + kh) * dim,
                                    dim * sizeof(float));
                    }
                }
                barrier.wait();
#pragma omp for schedule(static) nowait
                for (int64_t rh = 0; rh < rows * heads; rh++) {
                    const int64_t r = rh / heads, hd = rh % heads;
                    const int64_t at = kv_row(r) + (hd / group) * head_stride;
                    v.attend_head(qkv + r * width + hd * dim, lk + at, lv + at,
                                  mask ? (sequence ? mask : mask + r * columns) : nullptr,
                                  sequence ? column + r + 1 : columns, dim, L.scale, p,
                                  att + rh * dim);
                }
                barrier.wait();
                product_for(v, L.o, att, rows, xp, delta, int8, barrier);
#pragma omp for schedule(static) nowait
                for (int64_t r = 0; r < rows; r++)
                    rms_norm_row(h + r * size, delta + r * size, size, L.norm_post, L.eps_post,
                                 x + r * size);
                barrier.wait();
                product_for(v, L.gate_up, x, rows, xp, gate_up, int8, barrier);
#pragma omp for schedule(static) nowait
                for (int64_t r = 0; r < rows; r++)
                    v.silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter,
                               act + r * inter, inter);
                barrier.wait();
                product_for(v, L.down, act, rows, xp, delta, int8, barrier);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                rms_norm_row(h + r * size, delta + r * size, size, norm, eps, states + r * size);
        }
    }
    for (float *buffer : {x, xp, qkv, att, delta, gate_up, act, scores}) std::free(buffer);
    return failed ? -1 : 0;
}

}  // namespace omni
