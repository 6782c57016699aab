/* The reference kernels: plain C++ that any CPU runs, the yardstick every variant is
 * tested against (the same dequantisation bit for bit; sums in their own order), and
 * the row functions every variant shares (the norm, rotary, tile packing). */
#include "kernels.h"

namespace omni {
namespace {

/* One 32-weight block of output row r, block j, as float32: (d * q) + m, rounded
 * twice (this file is built with -ffp-contract=off). */
void block_weights(const BlockWeight &w, int64_t block, float *out) {
    const float d = half_to_float(w.d[block]);
    if (w.kind == Q4_1) {
        const uint8_t *q = static_cast<const uint8_t *>(w.qs) + block * (QK / 2);
        const float m = half_to_float(w.m[block]);
        for (int64_t i = 0; i < QK / 2; i++) {
            out[i] = d * static_cast<float>(q[i] & 0x0F) + m;
            out[i + QK / 2] = d * static_cast<float>(q[i] >> 4) + m;
        }
    } else {
        const int8_t *q = static_cast<const int8_t *>(w.qs) + block * QK;
        for (int64_t i = 0; i < QK; i++) out[i] = d * static_cast<float>(q[i]);
    }
}

/* Each output row's blocks in order, each block's 32 products summed in order. */
void product_rows(const BlockWeight &w, const float *x, int64_t rows, int64_t n0, int64_t n1,
                  float *y) {
    const int64_t nb = w.k / QK;
    float wb[QK];
    for (int64_t r = n0; r < n1; r++) {
        for (int64_t b0 = 0; b0 < rows; b0 += ROW_TILE) {
            const int64_t bt = rows - b0 < ROW_TILE ? rows - b0 : ROW_TILE;
            float acc[ROW_TILE] = {0};
            for (int64_t j = 0; j < nb; j++) {
                block_weights(w, r * nb + j, wb);
                for (int64_t b = 0; b < bt; b++) {
                    const float *xb = x + (b0 + b) * w.k + j * QK;
                    float s = 0.0f;
                    for (int64_t i = 0; i < QK; i++) s += wb[i] * xb[i];
                    acc[b] += s;
                }
            }
            for (int64_t b = 0; b < bt; b++) y[(b0 + b) * w.n + r] = acc[b];
        }
    }
}

/* One block's integer dot product, exact: 4-bit weights 0..15 or 8-bit -128..127 by
 * activations -127..127, 32 of them, well inside int32. */
int32_t block_dot(const BlockWeight &w, int64_t block, const int8_t *x) {
    int32_t sum = 0;
    if (w.kind == Q4_1) {
        const uint8_t *q = static_cast<const uint8_t *>(w.qs) + block * (QK / 2);
        for (int64_t i = 0; i < QK / 2; i++)
            sum += (q[i] & 0x0F) * x[i] + (q[i] >> 4) * x[i + QK / 2];
    } else {
        const int8_t *q = static_cast<const int8_t *>(w.qs) + block * QK;
        for (int64_t i = 0; i < QK; i++) sum += q[i] * x[i];
    }
    return sum;
}

/* Each (output row, activation row): its blocks in order, (d_w d_x) * dot each; the
 * Q4_1 minimums' sum (m_w s_x over the blocks, in order) added at the end. */
void product_q8(const BlockWeight &w, const Q8Rows &x, int64_t rows, int64_t n0, int64_t n1,
                float *y) {
    const int64_t nb = w.k / QK;
    for (int64_t r = n0; r < n1; r++)
        for (int64_t b = 0; b < rows; b++) {
            const int8_t *xq = x.q + b * w.k;
            const float *xd = x.d + b * nb, *xs = x.s + b * nb;
            float acc = 0.0f, mins = 0.0f;
            for (int64_t j = 0; j < nb; j++) {
                const int64_t block = r * nb + j;
                acc += (half_to_float(w.d[block]) * xd[j]) *
                       static_cast<float>(block_dot(w, block, xq + j * QK));
                if (w.kind == Q4_1) mins += half_to_float(w.m[block]) * xs[j];
            }
            y[b * w.n + r] = acc + mins;
        }
}

void dequant(const BlockWeight &w, int64_t b0, int64_t b1, float *out) {
    for (int64_t b = b0; b < b1; b++) block_weights(w, b, out + b * QK);
}

void silu_row(const float *g, const float *u, float *o, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}

void attend_head(const float *q, const float *k, const float *v, const uint8_t *seen,
                 int64_t columns, int64_t dim, float scale, float *p, float *o) {
    float top = -INFINITY;
    for (int64_t j = 0; j < columns; j++) {
        p[j] = seen && !seen[j] ? -INFINITY : dot(q, k + j * dim, dim) * scale;
        top = p[j] > top ? p[j] : top;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < columns; j++) total += (p[j] = std::exp(p[j] - top));
    for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
    for (int64_t j = 0; j < columns; j++)
        for (int64_t i = 0; i < dim; i++) o[i] += p[j] * v[j * dim + i];
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < dim; i++) o[i] *= inv;
}

bool always() { return true; }

}  // namespace

const Variant reference_variant = {
    "reference", "nothing", always, false, product_rows, product_q8, dequant, silu_row, attend_head,
};

/* Activation rows go in tiles of 8; what is left in one tile of 8, 4, 2 or 1 padded
 * with zero rows (5 to 7 rows: 8; 3: 4). Each tile dequantises every weight block
 * again, so 7 rows as 4 + 2 + 1 cost more than 8 (a stage's 7-row decode step:
 * docs/benchmarks.md), while a padded row costs only its FMAs. A
 * row's sum does not depend on its tile. */
void pack_blocks(const BlockWeight &w, uint8_t *out) {
    const int64_t nb = w.k / QK, record = PACKED_RECORD[w.kind];
    const int64_t quant_bytes = w.kind == Q4_1 ? QK / 2 : QK, chunks = quant_bytes / 4;
    const uint8_t *qs = static_cast<const uint8_t *>(w.qs);
    for (int64_t g = 0; g < w.n / PACK_ROWS; g++)
        for (int64_t j = 0; j < nb; j++) {
            uint8_t *at = out + (g * nb + j) * record;
            uint16_t *d = reinterpret_cast<uint16_t *>(at + chunks * 64), *m = d + PACK_ROWS;
            for (int64_t r = 0; r < PACK_ROWS; r++) {
                const int64_t block = (g * PACK_ROWS + r) * nb + j;
                for (int64_t t = 0; t < chunks; t++)
                    std::memcpy(at + t * 64 + r * 4, qs + block * quant_bytes + 4 * t, 4);
                d[r] = w.d[block];
                if (w.kind == Q4_1) m[r] = w.m[block];
            }
        }
}

int64_t tile_width(int64_t left) { return left >= 5 ? 8 : left >= 3 ? 4 : left; }

int64_t tiled_rows(int64_t rows) {
    return rows / ROW_TILE * ROW_TILE + (rows % ROW_TILE ? tile_width(rows % ROW_TILE) : 0);
}

/* x [rows][k] into tiles: tile by tile, each [k/32][its rows][32], padding rows zero,
 * so a tile's rows sit at fixed offsets from one pointer. */
void pack_tiles(const float *x, int64_t rows, int64_t k, float *xp) {
    for (int64_t b0 = 0, bt; b0 < rows; b0 += bt) {
        bt = tile_width(rows - b0);
        const int64_t real = rows - b0 < bt ? rows - b0 : bt;
        float *tile = xp + b0 * k;
        for (int64_t j = 0; j < k / QK; j++)
            for (int64_t b = 0; b < bt; b++) {
                float *to = tile + (j * bt + b) * QK;
                if (b < real)
                    std::memcpy(to, x + (b0 + b) * k + j * QK, QK * sizeof(float));
                else
                    std::memset(to, 0, QK * sizeof(float));
            }
    }
}

/* Rounding to nearest, ties to even, by adding and taking away 1.5 * 2^23 (exact for
 * |v| < 2^22; this file is built with -ffp-contract=off): the same in every variant
 * and in torch.round, and the loop vectorises. */
void quantize_q8_row(const float *x, int64_t k, int8_t *q, float *d, float *s) {
    constexpr float magic = 12582912.0f;
    for (int64_t j = 0; j < k / QK; j++) {
        const float *xj = x + j * QK;
        float amax = 0.0f;
        for (int64_t i = 0; i < QK; i++) amax = std::fmax(amax, std::fabs(xj[i]));
        const float dj = amax / 127.0f, inv = dj != 0.0f ? 1.0f / dj : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < QK; i++) {
            const int32_t v = static_cast<int32_t>((xj[i] * inv + magic) - magic);
            q[j * QK + i] = static_cast<int8_t>(v);
            sum += v;
        }
        d[j] = dj;
        s[j] = dj * static_cast<float>(sum);
    }
}

void spread_q8_scales(const float *d, int64_t blocks, float *d8) {
    for (int64_t j = 0; j < blocks; j++)
        for (int64_t i = 0; i < 8; i++) d8[j * 8 + i] = d[j];
}

Q8Rows q8_rows(float *scratch, int64_t rows, int64_t k) {
    int8_t *q = reinterpret_cast<int8_t *>(scratch);
    float *d8 = reinterpret_cast<float *>(q + ((rows * k + 63) & ~int64_t{63}));
    float *d = d8 + rows * (k / QK) * 8;
    return {q, d, d + rows * (k / QK), d8, k};
}

/* A float32 dot product over 16 partial sums, added pairwise at the end. */
float dot(const float *a, const float *b, int64_t n) {
    constexpr int64_t lanes = 16;
    float part[lanes] = {0}, tail = 0.0f;
    int64_t i = 0;
    for (; i + lanes <= n; i += lanes)
        for (int64_t l = 0; l < lanes; l++) part[l] += a[i + l] * b[i + l];
    for (; i < n; i++) tail += a[i] * b[i];
    for (int64_t width = lanes / 2; width; width /= 2)
        for (int64_t l = 0; l < width; l++) part[l] += part[l + width];
    return part[0] + tail;
}

void rms_norm_row(float *h, const float *delta, int64_t n, const float *weight, float eps,
                  float *out) {
    if (delta)
        for (int64_t i = 0; i < n; i++) h[i] += delta[i];
    const float scale = 1.0f / std::sqrt(dot(h, h, n) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (h[i] * scale);
}

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

}  // namespace omni
