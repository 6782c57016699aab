/* The CPU kernels' one header, laid out as ggml-cpu is: the reference functions in
 * reference.cpp (plain C++, any CPU), each instruction set's variant in its own file
 * (x86/avx2.cpp, x86/avx512.cpp), the best variant this CPU runs picked once
 * (dispatch.cpp), the OpenMP drivers over them (parallel.cpp), a decode step's layer
 * stack (stack.cpp), and the torch ops that take tensors (ops.cpp).
 *
 * Weights in GGUF blocks (32 weights a block): Q4_1 (w = d * q + m, q in 0..15) and
 * Q8_0 (w = d * q, q in -128..127); d and m stay the file's float16. Every variant
 * dequantises a weight as gguf-py does, (d * q) + m rounded twice in float32 (so
 * -ffp-contract=off, and no FMA in a dequantisation), so a weight is bit for bit the
 * float32 the plain path loads; only the order of a product's additions differs
 * between variants.
 *
 * Products take float32 activations, or the same rounded to 8 bits (Q8Rows: llama.cpp's
 * Q8_1 scheme) and multiplied with integer dot products: a block's 32 products of
 * 4- or 8-bit weights by 8-bit activations summed exactly in int32, then scaled once,
 * about half the instructions of dequantising the block to float32. */
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace omni {

constexpr int64_t QK = 32;       /* weights per block */
constexpr int64_t ROW_TILE = 8;  /* activation rows a product takes at a time */

/* IEEE half to float, exactly (every half is a float). */
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
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
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

/* One weight in blocks. Q4_1: qs uint8 [n][k/32][16], byte j holding weight j (low
 * nibble) and j + 16 (high); d, m float16 [n][k/32]. Q8_0: qs int8 [n][k/32][32], d
 * float16 [n][k/32], m null. bias float32 [n] or null. */
enum BlockKind : int64_t { Q4_1 = 0, Q8_0 = 1 };
struct BlockWeight {
    int64_t kind;
    const void *qs;
    const uint16_t *d, *m;
    int64_t n, k;
    const float *bias;
    /* The same weight laid out for 8-bit products (pack_blocks), or null. */
    const uint8_t *packed = nullptr;
};

/* A weight packed for the 8-bit products: its rows in groups of PACK_ROWS, each
 * group's block j one record, the records group by group. Its quants in 64-byte
 * chunks, chunk t the group's rows side by side, 4 bytes a row: a row's block bytes
 * 4t..4t+3. Q4_1 (PACKED_RECORD[Q4_1], 320 bytes): four chunks (weights 4t..4t+3 in
 * the low nibbles, 16+4t..16+4t+3 in the high), then the 16 rows' d (float16), then
 * their m. Q8_0 (544 bytes): eight chunks (weights 4t..4t+3, int8), then the d.
 * So one 512-bit load holds four weights of 16 rows (256 bits: of 8 rows), each 32-bit
 * lane a row: an integer dot product against four activation bytes broadcast gives 16
 * rows' partial sums at once, a block's scale (and minimum) is one vector for 16 rows,
 * and the outputs leave as vectors, with no sum across lanes (llama.cpp's repacked
 * "8x8" layouts, ggml-cpu/repack.cpp, are the same idea). The bytes are the file's,
 * rearranged: as many as qs, d and m. n must be a multiple of PACK_ROWS. */
constexpr int64_t PACK_ROWS = 16;
constexpr int64_t PACKED_RECORD[2] = {320, 544}; /* by BlockKind */
void pack_blocks(const BlockWeight &w, uint8_t *out);

/* Every x86 product, reading a weight row's blocks, asks memory for the same blocks
 * PREFETCH_ROWS rows below (each block struct's prefetch; never past the weight's
 * end). A decode step reads each weight byte once, from DRAM (a model's weights do
 * not stay in cache from one token to the next), and the hardware prefetcher alone,
 * with the few weight rows a tile walks side by side, streamed well under what a core
 * can: SmolLM2's Q8_0 output head (49152 x 576) took 4.9 ms at one row, ~6 GB/s. With
 * 16 rows ahead into L1 a one-row decode step of SmolLM2 on one thread took ~20 % less
 * on AVX2 and AVX-512, float32 and 8-bit activations alike; at eight rows, where the
 * arithmetic per byte is eight times more, ~5 %. Two threads on the head still
 * streamed 13-16 GB/s where a plain sum streams 40: with 32 rows ahead (9 to 18 KiB of
 * SmolLM2's weights) into L2 (PREFETCH_LOCALITY 1, prefetcht2; L1's few miss buffers
 * no longer hold the stream back) the head's product in a decode step took 2.3-2.7 ms
 * -> 1.5-1.8 ms (docs/benchmarks.md). */
constexpr int64_t PREFETCH_ROWS = 32;
constexpr int PREFETCH_LOCALITY = 1;
inline void prefetch_weight(const void *at) { __builtin_prefetch(at, 0, PREFETCH_LOCALITY); }

/* Activation rows rounded to 8 bits, per 32-block of a row as llama.cpp's Q8_1 does:
 * d = max|x| / 127, q = x * (1 / d) rounded to nearest (ties to even), s = d * sum(q)
 * (the block sum a Q4_1 weight's minimum multiplies). q int8 [rows][k]; d and s
 * float32 [rows][k/32]. Every variant quantises with the same function, so the
 * rounded activations are bit for bit one's whatever the variant. d8 holds d again,
 * each value 8 times over ([rows][k/32][8]): the vector products load a block's scale
 * (two blocks' side by side in 512 bits) as it is, where a broadcast or a permute per
 * weight row and activation row cost an instruction of the few a block takes. */
struct Q8Rows {
    int8_t *q;
    float *d, *s, *d8;
    int64_t k;
};
void quantize_q8_row(const float *x, int64_t k, int8_t *q, float *d, float *s);
/* d8 of one row: each of its k/32 scales d 8 times over. */
void spread_q8_scales(const float *d, int64_t blocks, float *d8);
/* Q8Rows for `rows` rows of k laid out in scratch that holds tiled_rows(rows) * k
 * floats (at least 2.25 bytes a value, as it must). */
Q8Rows q8_rows(float *scratch, int64_t rows, int64_t k);
/* Whether the OS saves the register state in `xcr0_bits` (XCR0 via xgetbv, after
 * CPUID's OSXSAVE): a CPU with AVX-512 under an OS that does not save the zmm
 * registers must not run it. */
bool os_saves(uint64_t xcr0_bits);
constexpr uint64_t XCR0_AVX = 0x6;      /* SSE and AVX state */
constexpr uint64_t XCR0_AVX512 = 0xE6;  /* and opmask, zmm0-15 high halves, zmm16-31 */

/* One instruction set's kernels. A product computes y[b][r] = sum_k W[r][k] x[b][k]
 * for the output rows r in [n0, n1) and every activation row b (y is [rows][w.n]);
 * where `packs`, x comes packed in tiles (pack_tiles) for rows > 1. */
struct Variant {
    const char *name;
    const char *needs; /* the instruction sets it runs on, for messages */
    bool (*supported)();
    bool packs;
    void (*product_rows)(const BlockWeight &w, const float *x, int64_t rows, int64_t n0,
                         int64_t n1, float *y);
    /* The same over 8-bit activations: y[b][r] = sum over blocks of d_w d_x (q_w . q_x)
     * (+ m_w s_x for Q4_1), each block's integer dot product exact in int32. */
    void (*product_q8)(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                       int64_t n1, float *y);
    /* Blocks [b0, b1) of the weight (row-major: block j of row r is r * k/32 + j) to
     * float32 at out + b * 32. */
    void (*dequant)(const BlockWeight &w, int64_t b0, int64_t b1, float *out);
    /* o[i] = silu(g[i]) * u[i] */
    void (*silu_row)(const float *g, const float *u, float *o, int64_t n);
    /* softmax(q k^T * scale) v for one query q [dim] against `columns` keys k and values
     * v [columns][dim] (those whose byte in `seen` is set, where given); p is scratch
     * for columns + 16 floats, o [dim] the result. */
    void (*attend_head)(const float *q, const float *k, const float *v, const uint8_t *seen,
                        int64_t columns, int64_t dim, float scale, float *p, float *o);
    /* product_q8 over w.packed, for output rows [n0, n1) whole groups of PACK_ROWS; null
     * where the variant has none (product_q8 then reads qs, d and m). Each output is the
     * sum over blocks of (d_w d_x) (q_w . q_x), plus the sum of m_w s_x kept apart, each
     * row's the same in any tile. */
    void (*product_packed)(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0,
                           int64_t n1, float *y) = nullptr;
};

/* dispatch.cpp: the variants this build has, best first (the reference last), and
 * the one in use: the best this CPU runs unless use_variant chose another. */
const Variant *const *all_variants(int64_t *count);
const Variant &active_variant();
/* Makes `name` the active variant; returns null, or why not (unknown, or this CPU
 * lacks what it needs). */
const char *use_variant(const char *name);

/* reference.cpp: the reference variant, and the row functions every variant shares. */
extern const Variant reference_variant;
int64_t tile_width(int64_t left);
int64_t tiled_rows(int64_t rows);
void pack_tiles(const float *x, int64_t rows, int64_t k, float *xp);
float dot(const float *a, const float *b, int64_t n);
/* h += delta (when given), then out = weight * (h * rsqrt(mean(h^2) + eps)): Llama's
 * float32 RMSNorm after the residual add; out may be h. */
void rms_norm_row(float *h, const float *delta, int64_t n, const float *weight, float eps,
                  float *out);
/* Rotary embeddings in place on the first `heads` heads of x (rotate_half's layout),
 * cos and sin [dim]: transformers' apply_rotary_pos_emb, bit for bit. */
void rotary_row(float *x, int64_t heads, int64_t dim, const float *cos, const float *sin);

#if defined(__x86_64__) && !defined(OMNI_GENERIC_KERNELS)
extern const Variant avx2_variant, avx512_variant, avx512vnni_variant;
#endif

/* parallel.cpp: the drivers, each its own OpenMP region of `threads`. */
float *aligned_floats(int64_t count); /* 64-byte aligned, freed with free() */
/* `int8`: the activations rounded to 8 bits first (Q8Rows), integer dot products. */
int block_product(const Variant &v, const BlockWeight &w, const float *x, int64_t rows, float *y,
                  bool int8, int threads); /* 0, or -1 when out of memory */
/* The same inside a parallel region: xp holds tiled_rows(rows) * k floats (packed by
 * one thread where the variant packs, or the rows rounded to 8 bits), output rows
 * shared out by an orphaned omp for; the bias added. */
void product_for(const Variant &v, const BlockWeight &w, const float *x, int64_t rows,
                 float *xp, float *y, bool int8);

/* A barrier for one parallel region's team that spins (with a pause, yielding now and
 * then) instead of sleeping. libgomp's own barriers spin only briefly once the process
 * holds more OpenMP threads than CPUs (any other thread that ever ran a parallel
 * region keeps an idle team): then every barrier is a futex sleep and wake, and a
 * decode step's ~8 barriers a layer cost more than a second thread saves (SmolLM2 at
 * one row, with and without this: docs/benchmarks.md). llama.cpp's pool spins too.
 * `team` is set by one thread (omp single) before the first wait. */
struct SpinBarrier {
    std::atomic<int> arrived{0};
    std::atomic<int> phase{0};
    int team = 1;
    void wait();
};
/* product_for with the team meeting at `barrier` instead of libgomp's (no implicit
 * barrier is left: its omp fors are nowait). */
void product_for(const Variant &v, const BlockWeight &w, const float *x, int64_t rows,
                 float *xp, float *y, bool int8, SpinBarrier &barrier);
void dequantize(const Variant &v, const BlockWeight &w, float *out, int threads);
void add_rms_norm(float *h, const float *delta, int64_t rows, int64_t n, const float *weight,
                  float eps, float *out, int threads);
void silu_mul(const Variant &v, const float *gate_up, int64_t rows, int64_t inter, float *out,
              int threads);
void rotary(float *x, int64_t rows, int64_t width, int64_t heads, int64_t dim, const float *cos,
            const float *sin, int threads);
/* One query per row against that row's keys and values, grouped-query: out[r][h] over
 * the row's `columns` keys (those set in mask [rows][mask_row], where given), query
 * head h reading kv head h / (heads / kv_heads). Strides in floats: q (q_row,
 * q_head), keys and values [rows][kv_heads][columns][dim] (kv_row, kv_head);
 * out [rows][heads][dim]. 0, or -1 when out of memory. */
int attend_one(const Variant &v, const float *q, int64_t q_row, int64_t q_head,
               const float *keys, const float *values, int64_t kv_row, int64_t kv_head,
               const uint8_t *mask, int64_t mask_row, int64_t rows, int64_t heads,
               int64_t kv_heads, int64_t columns, int64_t dim, float scale, float *out,
               int threads);

/* stack.cpp: one layer of a Llama-shaped decoder. */
struct StackLayer {
    const float *norm_in, *norm_post; /* RMSNorm weights [size] */
    const float *q_norm, *k_norm;     /* per-head RMSNorm weights [dim] (Qwen3), or null */
    float eps_in, eps_post, eps_head, scale;
    BlockWeight qkv, o, gate_up, down;
};
struct StackShape {
    int64_t layers, heads, kv_heads, dim, size, inter;
};
/* A decode step through every layer: h [rows][size] (each row's new token embedded)
 * is the residual stream, added into in place; layer l writes its keys and values at
 * column `column` of keys/values + l * layer_stride ([rows][kv_heads][room][dim],
 * row and head strides in floats), and attends columns 0..column (those set in mask
 * [rows][column + 1], where given); states [rows][size] gets the final norm's
 * output; `int8`: every product on 8-bit activations. As a `sequence` (a prefill of
 * one cache row: keys/values [1][kv_heads][room][dim]; mask, where given, the row's
 * [column + rows]), row r of h is the position at column + r: it writes there and
 * attends columns 0..column + r (those set in the mask), so the call is, bit for
 * bit, `rows` one-row steps at columns column, column + 1, ...
 * 0, or -1 when out of memory. */
int decode_stack(const Variant &v, const StackLayer *layers, const StackShape &shape, float *h,
                 int64_t rows, const float *cos, const float *sin, float *keys, float *values,
                 int64_t layer_stride, int64_t row_stride, int64_t head_stride,
                 const uint8_t *mask, int64_t column, const float *norm, float eps,
                 float *states, bool int8, bool sequence, int threads);

}  // namespace omni
