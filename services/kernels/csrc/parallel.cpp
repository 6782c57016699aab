/* The kernels over OpenMP threads, each call its own parallel region. Built against
 * the libgomp torch itself loads (same soname), so they share torch's thread pool.
 * Threads split output rows, blocks, rows or heads, never a sum, so the thread count
 * changes no result. */
#include <sched.h>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define OMNI_PAUSE() _mm_pause()
#else
#define OMNI_PAUSE() ((void)0)
#endif

namespace omni {
namespace {

/* Output rows per OpenMP chunk: small enough to balance two to a few dozen threads,
 * big enough that a chunk reads a few pages of weights. */
constexpr int64_t ROW_CHUNK = 16;
static_assert(ROW_CHUNK % PACK_ROWS == 0, "a chunk is whole packed groups");
/* Blocks per chunk of a dequantisation (128 KiB of float32 out). */
constexpr int64_t DEQUANT_CHUNK = 1024;
/* A decode step has 1 to a few dozen rows: the glue splits rows over threads only from
 * this many floats of work, below which a parallel region costs more than it saves
 * (measured on SmolLM2's widths, 2 threads). */
constexpr int64_t GLUE_PARALLEL = 16384;

}  // namespace

float *aligned_floats(int64_t count) {
    return static_cast<float *>(
        std::aligned_alloc(64, (static_cast<size_t>(count) * sizeof(float) + 63) & ~size_t{63}));
}

namespace {

/* The output rows of one product, shared out by an orphaned omp for (nowait). */
void rows_for(const Variant &v, const BlockWeight &w, const float *in, const Q8Rows &q8,
              int64_t rows, float *y, bool int8) {
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < (w.n + ROW_CHUNK - 1) / ROW_CHUNK; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = n0 + ROW_CHUNK < w.n ? n0 + ROW_CHUNK : w.n;
        if (int8 && w.packed && v.product_packed)
            v.product_packed(w, q8, rows, n0, n1, y);
        else if (int8)
            v.product_q8(w, q8, rows, n0, n1, y);
        else
            v.product_rows(w, in, rows, n0, n1, y);
    }
}

/* The activations ready for the product: rounded to 8 bits (rows shared out), or
 * packed by one thread where the variant packs; nowait, a barrier to follow. */
const float *prepare_for(const Variant &v, const float *x, int64_t rows, int64_t k, float *xp,
                         const Q8Rows &q8, bool int8) {
    if (int8) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; r++) {
            const int64_t nb = k / QK;
            quantize_q8_row(x + r * k, k, q8.q + r * k, q8.d + r * nb, q8.s + r * nb);
            spread_q8_scales(q8.d + r * nb, nb, q8.d8 + r * nb * 8);
        }
        return x;
    }
    if (v.packs && rows > 1) {
#pragma omp single nowait
        pack_tiles(x, rows, k, xp);
        return xp;
    }
    return x;
}

bool needs_scratch(const Variant &v, int64_t rows, bool int8) {
    return int8 || (v.packs && rows > 1);
}

}  // namespace

void product_for(const Variant &v, const BlockWeight &w, const float *x, int64_t rows,
                 float *xp, float *y, bool int8) {
    const Q8Rows q8 = int8 ? q8_rows(xp, rows, w.k) : Q8Rows{};
    const float *in = prepare_for(v, x, rows, w.k, xp, q8, int8);
    if (needs_scratch(v, rows, int8)) {
#pragma omp barrier
    }
    rows_for(v, w, in, q8, rows, y, int8);
#pragma omp barrier
    if (w.bias) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < w.n; i++) y[r * w.n + i] += w.bias[i];
    }
}

void SpinBarrier::wait() {
    if (team <= 1) return;
    const int seen = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
        arrived.store(0, std::memory_order_relaxed);
        phase.store(seen + 1, std::memory_order_release);
        return;
    }
    for (int spins = 1; phase.load(std::memory_order_acquire) == seen; spins++) {
        OMNI_PAUSE();
        if (spins % 4096 == 0) sched_yield(); /* a team mate descheduled: let it run */
    }
}

void product_for(const Variant &v, const BlockWeight &w, const float *x, int64_t rows,
                 float *xp, float *y, bool int8, SpinBarrier &barrier) {
    const Q8Rows q8 = int8 ? q8_rows(xp, rows, w.k) : Q8Rows{};
    const float *in = prepare_for(v, x, rows, w.k, xp, q8, int8);
    if (needs_scratch(v, rows, int8)) barrier.wait();
    rows_for(v, w, in, q8, rows, y, int8);
    barrier.wait();
    if (w.bias) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < w.n; i++) y[r * w.n + i] += w.bias[i];
        barrier.wait();
    }
}

int block_product(const Variant &v, const BlockWeight &w, const float *x, int64_t rows, float *y,
                  bool int8, int threads) {
    /* 64-byte aligned tiles: a 512-bit load then never straddles two cache lines (a
     * token's products at 8 rows measured slower unaligned: docs/benchmarks.md). */
    const bool scratch = needs_scratch(v, rows, int8);
    float *xp = scratch ? aligned_floats(tiled_rows(rows) * w.k) : nullptr;
    if (scratch && !xp) return -1;
#pragma omp parallel num_threads(threads)
    product_for(v, w, x, rows, xp, y, int8);
    std::free(xp);
    return 0;
}

void dequantize(const Variant &v, const BlockWeight &w, float *out, int threads) {
    const int64_t blocks = w.n * (w.k / QK);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < (blocks + DEQUANT_CHUNK - 1) / DEQUANT_CHUNK; c++) {
        const int64_t b0 = c * DEQUANT_CHUNK;
        v.dequant(w, b0, b0 + DEQUANT_CHUNK < blocks ? b0 + DEQUANT_CHUNK : blocks, out);
    }
}

void add_rms_norm(float *h, const float *delta, int64_t rows, int64_t n, const float *weight,
                  float eps, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(h + r * n, delta ? delta + r * n : nullptr, n, weight, eps, out + r * n);
}

void silu_mul(const Variant &v, const float *gate_up, int64_t rows, int64_t inter, float *out,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        v.silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter,
                   inter);
}

void rotary(float *x, int64_t rows, int64_t width, int64_t heads, int64_t dim, const float *cos,
            const float *sin, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * dim >= GLUE_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        rotary_row(x + r * width, heads, dim, cos + r * dim, sin + r * dim);
}

int attend_one(const Variant &v, const float *q, int64_t q_row, int64_t q_head,
               const float *keys, const float *values, int64_t kv_row, int64_t kv_head,
               const uint8_t *mask, int64_t mask_row, int64_t rows, int64_t heads,
               int64_t kv_heads, int64_t columns, int64_t dim, float scale, float *out,
               int threads) {
    const int64_t group = heads / kv_heads, work = rows * heads * columns * dim;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (work >= 4 * GLUE_PARALLEL)
    {
        float *p = aligned_floats(columns + 16);
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows * heads; rh++) {
            if (!p) continue;
            const int64_t r = rh / heads, hd = rh % heads;
            const int64_t kv = r * kv_row + (hd / group) * kv_head;
            v.attend_head(q + r * q_row + hd * q_head, keys + kv, values + kv,
                          mask ? mask + r * mask_row : nullptr, columns, dim, scale, p,
                          out + rh * dim);
        }
        std::free(p);
    }
    return failed ? -1 : 0;
}

}  // namespace omni
