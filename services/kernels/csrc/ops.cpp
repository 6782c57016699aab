/* The kernels as torch ops (torch.ops.omni_kernels.*): each takes tensors and checks
 * their dtype, shape, strides and device before a pointer is taken, naming the
 * argument in the error, so a wrong call is a RuntimeError and never a stray write.
 * The decode stack's weights are checked once, when a DecodeStack is built. */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "kernels.h"

/* The build hash (setup.py: build_hash.py) comes as a bare token, stringified here:
 * a quoted string would not survive every build tool's shell. */
#ifndef OMNI_KERNELS_HASH
#define OMNI_KERNELS_HASH unknown
#endif
#define OMNI_STRING(token) #token
#define OMNI_EXPAND(token) OMNI_STRING(token)

namespace omni::ops {

int threads() { return at::get_num_threads(); }

void check(const Tensor &t, const char *name, at::ScalarType dtype, at::IntArrayRef shape) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, not ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", not ", t.scalar_type());
    TORCH_CHECK(t.sizes() == shape, name, " must be ", shape, ", not ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (strides ", t.strides(), ")");
}

void check_2d(const Tensor &t, const char *name) {
    TORCH_CHECK(t.dim() == 2, name, " must be 2-D, not ", t.sizes());
    check(t, name, at::kFloat, t.sizes());
}

/* A weight in blocks: qs uint8 [n][k/32][16] with m (Q4_1) or int8 [n][k/32][32]
 * without (Q8_0); d and m float16 [n][k/32]; bias float32 [n]; packed (either kind)
 * uint8 [n/16][k/32][320 (Q4_1) or 544 (Q8_0)], pack_blocks' of the same weight. */
BlockWeight block_weight(const Tensor &qs, const Tensor &d, const std::optional<Tensor> &m,
                         const std::optional<Tensor> &bias, const std::string &name,
                         const std::optional<Tensor> &packed) {
    TORCH_CHECK(qs.dim() == 3, name, ".qs must be [n, k/32, 16 or 32], not ", qs.sizes());
    const int64_t n = qs.size(0), blocks = qs.size(1);
    const bool q4_1 = qs.scalar_type() == at::kByte;
    TORCH_CHECK(q4_1 || qs.scalar_type() == at::kChar, name,
                ".qs must be uint8 (Q4_1) or int8 (Q8_0), not ", qs.scalar_type());
    check(qs, (name + ".qs").c_str(), qs.scalar_type(), {n, blocks, q4_1 ? 16 : 32});
    check(d, (name + ".d").c_str(), at::kHalf, {n, blocks});
    TORCH_CHECK(m.has_value() == q4_1, name, q4_1 ? ": Q4_1 blocks need m" : ": Q8_0 blocks take no m");
    if (m) check(*m, (name + ".m").c_str(), at::kHalf, {n, blocks});
    if (bias) check(*bias, (name + ".bias").c_str(), at::kFloat, {n});
    if (packed) {
        TORCH_CHECK(n % omni::PACK_ROWS == 0, name,
                    ": only weights of a multiple of 16 rows are packed, not ", n);
        check(*packed, (name + ".packed").c_str(), at::kByte,
              {n / omni::PACK_ROWS, blocks, omni::PACKED_RECORD[q4_1 ? omni::Q4_1 : omni::Q8_0]});
    }
    return {q4_1 ? omni::Q4_1 : omni::Q8_0,
            qs.data_ptr(),
            reinterpret_cast<const uint16_t *>(d.data_ptr()),
            m ? reinterpret_cast<const uint16_t *>(m->data_ptr()) : nullptr,
            n,
            blocks * omni::QK,
            bias ? bias->data_ptr<float>() : nullptr,
            packed ? packed->data_ptr<uint8_t>() : nullptr};
}

/* keys and values [...][columns or room][dim]: each key's dim floats and a head's keys
 * one after another; keys and values alike. */
void check_cache(const Tensor &keys, const Tensor &values, int64_t dims) {
    TORCH_CHECK(keys.dim() == dims, "keys must be ", dims, "-D, not ", keys.sizes());
    TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides(),
                "keys and values must have one shape and layout, not ", keys.sizes(),
                keys.strides(), " and ", values.sizes(), values.strides());
    TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
                "keys and values must be float32");
    TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu(), "keys and values on the CPU");
    TORCH_CHECK(keys.stride(dims - 1) == 1 && keys.stride(dims - 2) == keys.size(dims - 1),
                "each head's keys must be contiguous [columns, dim] (strides ", keys.strides(),
                ")");
}

}  // namespace omni::ops

namespace {

using at::Tensor;
using omni::BlockWeight;
using namespace omni::ops;

Tensor block_linear(const Tensor &x, const Tensor &qs, const Tensor &d,
                    const std::optional<Tensor> &m, const std::optional<Tensor> &bias,
                    bool int8, const std::optional<Tensor> &packed) {
    const BlockWeight w = block_weight(qs, d, m, bias, "weight", packed);
    check_2d(x, "x");
    TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " columns, the weight ", w.k);
    Tensor y = at::empty({x.size(0), w.n}, x.options());
    const int failed = omni::block_product(omni::active_variant(), w, x.data_ptr<float>(),
                                           x.size(0), y.data_ptr<float>(), int8, threads());
    TORCH_CHECK(!failed, "block_linear: out of memory");
    return y;
}

/* A weight of a multiple of 16 rows laid out for the 8-bit products: uint8
 * [n/16][k/32][320 (Q4_1) or 544 (Q8_0)] (kernels.h: pack_blocks). */
Tensor pack_blocks(const Tensor &qs, const Tensor &d, const std::optional<Tensor> &m) {
    const BlockWeight w = block_weight(qs, d, m, std::nullopt, "weight", std::nullopt);
    TORCH_CHECK(w.n % omni::PACK_ROWS == 0, "pack_blocks: the weight's ", w.n,
                " rows are not a multiple of ", omni::PACK_ROWS);
    Tensor out = at::empty({w.n / omni::PACK_ROWS, w.k / omni::QK, omni::PACKED_RECORD[w.kind]},
                           qs.options().dtype(at::kByte));
    omni::pack_blocks(w, out.data_ptr<uint8_t>());
    return out;
}

/* x's rows rounded to 8 bits as every 8-bit product rounds them: (q int8 [rows][k],
 * d and s float32 [rows][k/32]). */
std::tuple<Tensor, Tensor, Tensor> quantize_q8(const Tensor &x) {
    check_2d(x, "x");
    TORCH_CHECK(x.size(1) % omni::QK == 0, "x's width must be a multiple of 32, not ", x.size(1));
    const int64_t rows = x.size(0), k = x.size(1);
    Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
    Tensor d = at::empty({rows, k / omni::QK}, x.options()), s = at::empty_like(d);
    for (int64_t r = 0; r < rows; r++)
        omni::quantize_q8_row(x.data_ptr<float>() + r * k, k, q.data_ptr<int8_t>() + r * k,
                              d.data_ptr<float>() + r * (k / omni::QK),
                              s.data_ptr<float>() + r * (k / omni::QK));
    return {q, d, s};
}

void block_dequantize(const Tensor &qs, const Tensor &d, const std::optional<Tensor> &m,
                      Tensor &out) {
    const BlockWeight w = block_weight(qs, d, m, std::nullopt, "weight", std::nullopt);
    check(out, "out", at::kFloat, {w.n, w.k});
    omni::dequantize(omni::active_variant(), w, out.data_ptr<float>(), threads());
}

Tensor rms_norm(Tensor &h, const std::optional<Tensor> &delta, const Tensor &weight, double eps) {
    check_2d(h, "h");
    if (delta) check(*delta, "delta", at::kFloat, h.sizes());
    check(weight, "weight", at::kFloat, {h.size(1)});
    Tensor out = at::empty_like(h);
    omni::add_rms_norm(h.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr,
                       h.size(0), h.size(1), weight.data_ptr<float>(), static_cast<float>(eps),
                       out.data_ptr<float>(), threads());
    return out;
}

Tensor silu_mul(const Tensor &gate_up) {
    check_2d(gate_up, "gate_up");
    TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even, not ", gate_up.size(1));
    const int64_t inter = gate_up.size(1) / 2;
    Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
    omni::silu_mul(omni::active_variant(), gate_up.data_ptr<float>(), gate_up.size(0), inter,
                   out.data_ptr<float>(), threads());
    return out;
}

void rotary_(Tensor &x, int64_t heads, int64_t dim, const Tensor &cos, const Tensor &sin) {
    check_2d(x, "x");
    TORCH_CHECK(dim > 0 && dim % 2 == 0, "dim must be even and positive, not ", dim);
    TORCH_CHECK(heads >= 0 && heads * dim <= x.size(1), heads, " heads of ", dim,
                " do not fit a row of ", x.size(1));
    check(cos, "cos", at::kFloat, {x.size(0), dim});
    check(sin, "sin", at::kFloat, {x.size(0), dim});
    omni::rotary(x.data_ptr<float>(), x.size(0), x.size(1), heads, dim, cos.data_ptr<float>(),
                 sin.data_ptr<float>(), threads());
}

Tensor attend_one(const Tensor &q, const Tensor &keys, const Tensor &values,
                  const std::optional<Tensor> &mask, double scale) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu() &&
                    q.stride(2) == 1,
                "q must be float32 [rows, heads, dim] with each head contiguous, not ",
                q.scalar_type(), q.sizes(), q.strides());
    check_cache(keys, values, 4);
    const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
    const int64_t kv_heads = keys.size(1), columns = keys.size(2);
    TORCH_CHECK(keys.size(0) == rows && keys.size(3) == dim, "keys must be [", rows,
                ", kv_heads, columns, ", dim, "], not ", keys.sizes());
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && columns > 0, heads,
                " heads need a divisor as kv_heads and at least one column, not ", kv_heads,
                " and ", columns);
    if (mask) check(*mask, "mask", at::kByte, {rows, columns});
    Tensor out = at::empty({rows, heads * dim}, q.options());
    const int failed = omni::attend_one(
        omni::active_variant(), q.data_ptr<float>(), q.stride(0), q.stride(1),
        keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), keys.stride(1),
        mask ? mask->data_ptr<uint8_t>() : nullptr, columns, rows, heads, kv_heads, columns,
        dim, static_cast<float>(scale), out.data_ptr<float>(), threads());
    TORCH_CHECK(!failed, "attend_one: out of memory");
    return out;
}

std::string variant() { return omni::active_variant().name; }

std::vector<std::string> variants() {
    int64_t count;
    const omni::Variant *const *all = omni::all_variants(&count);
    std::vector<std::string> names;
    for (int64_t i = 0; i < count; i++) names.emplace_back(all[i]->name);
    return names;
}

const omni::Variant &find(const std::string &name) {
    int64_t count;
    const omni::Variant *const *all = omni::all_variants(&count);
    for (int64_t i = 0; i < count; i++)
        if (name == all[i]->name) return *all[i];
    TORCH_CHECK(false, "no kernel variant ", name, " in this build (", variants(), ")");
}

bool supports(const std::string &name) { return find(name).supported(); }
std::string needs(const std::string &name) { return find(name).needs; }

void use(const std::string &name) {
    const char *why = omni::use_variant(name.c_str());
    TORCH_CHECK(!why, "kernel variant ", name, ": ", why, " (", find(name).needs, ")");
}

std::string build_hash() { return OMNI_EXPAND(OMNI_KERNELS_HASH); }

}  // namespace

TORCH_LIBRARY(omni_kernels, m) {
    m.def("variant() -> str", &variant);
    m.def("variants() -> str[]", &variants);
    m.def("supports(str name) -> bool", &supports);
    m.def("needs(str name) -> str", &needs);
    m.def("use(str name) -> ()", &use);
    m.def("build_hash() -> str", &build_hash);
    m.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? bias, "
          "bool int8=False, Tensor? packed=None) -> Tensor",
          &block_linear);
    m.def("pack_blocks(Tensor qs, Tensor d, Tensor? m) -> Tensor", &pack_blocks);
    m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)", &quantize_q8);
    m.def("block_dequantize(Tensor qs, Tensor d, Tensor? m, Tensor(a!) out) -> ()",
          &block_dequantize);
    m.def("rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor",
          &rms_norm);
    m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
    m.def("rotary_(Tensor(a!) x, int heads, int dim, Tensor cos, Tensor sin) -> ()", &rotary_);
    m.def("attend_one(Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor",
          &attend_one);
}
