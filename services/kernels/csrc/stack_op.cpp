/* The decode stack as a torch class and op: a DecodeStack holds one model's layers,
 * every weight checked once when it is built (torch.classes.omni_kernels.DecodeStack),
 * and torch.ops.omni_kernels.decode_stack runs one step over it, checking the step's
 * tensors. */
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"

namespace {

using at::Tensor;
using namespace omni::ops;

/* Per layer, in `tensors`: norm_in, norm_post, q_norm?, k_norm?, then qs, d, m?, bias?,
 * packed? of qkv, o, gate_up and down; the final norm last. Per layer, in `scalars`: eps_in,
 * eps_post, eps_head (the per-head norms'), scale; the final norm's eps last. `dims`:
 * layers, heads, kv_heads, dim, size, inter. */
constexpr int64_t PER_WEIGHT = 5, TENSORS = 4 + 4 * PER_WEIGHT, SCALARS = 4;

struct DecodeStack : torch::CustomClassHolder {
    std::vector<Tensor> held; /* what the pointers below point into */
    std::vector<omni::StackLayer> layers;
    omni::StackShape shape{};
    const float *norm = nullptr;
    float eps = 0.0f;

    DecodeStack(const c10::List<std::optional<Tensor>> &tensors, std::vector<double> scalars,
                std::vector<int64_t> dims) {
        TORCH_CHECK(dims.size() == 6, "dims: layers, heads, kv_heads, dim, size, inter");
        shape = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]};
        const int64_t count = shape.layers, dim = shape.dim, size = shape.size;
        TORCH_CHECK(count >= 1 && shape.kv_heads >= 1 && shape.heads % shape.kv_heads == 0 &&
                        dim >= 2 && dim % 2 == 0 && size >= 1 && shape.inter >= 1,
                    "a decode stack needs layers >= 1, heads a multiple of kv_heads >= 1 and an "
                    "even dim, not ", dims);
        TORCH_CHECK(static_cast<int64_t>(tensors.size()) == count * TENSORS + 1 &&
                        static_cast<int64_t>(scalars.size()) == count * SCALARS + 1,
                    "a decode stack of ", count, " layers takes ", count * TENSORS + 1,
                    " tensors and ", count * SCALARS + 1, " scalars, not ", tensors.size(),
                    " and ", scalars.size());
        const int64_t width = (shape.heads + 2 * shape.kv_heads) * dim;
        const int64_t out[4] = {width, size, 2 * shape.inter, size};
        const int64_t in[4] = {size, shape.heads * dim, size, shape.inter};
        const char *names[4] = {"qkv", "o", "gate_up", "down"};
        for (int64_t l = 0; l < count; l++) {
            const std::string at = "layer " + std::to_string(l) + " ";
            auto tensor = [&](int64_t i) { return tensors.get(l * TENSORS + i); };
            auto vector = [&](int64_t i, int64_t length, const char *name) -> const float * {
                const std::optional<Tensor> t = tensor(i);
                if (!t) return nullptr;
                check(*t, (at + name).c_str(), at::kFloat, {length});
                held.push_back(*t);
                return t->data_ptr<float>();
            };
            omni::StackLayer layer{};
            layer.norm_in = vector(0, size, "norm_in");
            layer.norm_post = vector(1, size, "norm_post");
            TORCH_CHECK(layer.norm_in && layer.norm_post, at, "needs norm_in and norm_post");
            layer.q_norm = vector(2, dim, "q_norm");
            layer.k_norm = vector(3, dim, "k_norm");
            omni::BlockWeight *weights[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
            for (int w = 0; w < 4; w++) {
                const int64_t first = 4 + PER_WEIGHT * w;
                const std::optional<Tensor> qs = tensor(first), d = tensor(first + 1);
                TORCH_CHECK(qs && d, at, names[w], " needs qs and d");
                *weights[w] = block_weight(*qs, *d, tensor(first + 2), tensor(first + 3),
                                           at + names[w], tensor(first + 4));
                TORCH_CHECK(weights[w]->n == out[w] && weights[w]->k == in[w], at, names[w],
                            " is ", weights[w]->n, " x ", weights[w]->k, ", not ", out[w], " x ",
                            in[w]);
                for (int64_t i = first; i < first + PER_WEIGHT; i++)
                    if (tensor(i)) held.push_back(*tensor(i));
            }
            layer.eps_in = static_cast<float>(scalars[l * SCALARS]);
            layer.eps_post = static_cast<float>(scalars[l * SCALARS + 1]);
            layer.eps_head = static_cast<float>(scalars[l * SCALARS + 2]);
            layer.scale = static_cast<float>(scalars[l * SCALARS + 3]);
            layers.push_back(layer);
        }
        const std::optional<Tensor> final_norm = tensors.get(count * TENSORS);
        TORCH_CHECK(final_norm, "the final norm is missing");
        check(*final_norm, "norm", at::kFloat, {size});
        held.push_back(*final_norm);
        norm = final_norm->data_ptr<float>();
        eps = static_cast<float>(scalars.back());
    }
};

/* One step: h [rows][size] (added into), cos and sin [rows][dim], keys and values
 * [layers][rows][kv_heads][room][dim] (column `column` written), mask uint8
 * [rows][column + 1] or none. As a `sequence`: h's rows are one cache row's positions
 * column.. column + rows - 1 (keys and values [layers][1][kv_heads][room][dim], mask
 * [1][column + rows] or none). Returns the final norm's output [rows][size]. */
Tensor decode_stack(const c10::intrusive_ptr<DecodeStack> &stack, Tensor &h, const Tensor &cos,
                    const Tensor &sin, Tensor &keys, Tensor &values,
                    const std::optional<Tensor> &mask, int64_t column, bool int8,
                    bool sequence) {
    const omni::StackShape &shape = stack->shape;
    check_2d(h, "h");
    const int64_t rows = h.size(0);
    TORCH_CHECK(rows >= 1 && h.size(1) == shape.size, "h must be [rows >= 1, ", shape.size,
                "], not ", h.sizes());
    check(cos, "cos", at::kFloat, {rows, shape.dim});
    check(sin, "sin", at::kFloat, {rows, shape.dim});
    check_cache(keys, values, 5);
    const int64_t cache_rows = sequence ? 1 : rows, last = column + (sequence ? rows : 1) - 1;
    TORCH_CHECK(keys.size(0) == shape.layers && keys.size(1) == cache_rows &&
                    keys.size(2) == shape.kv_heads && keys.size(4) == shape.dim,
                "keys must be [", shape.layers, ", ", cache_rows, ", ", shape.kv_heads,
                ", room, ", shape.dim, "], not ", keys.sizes());
    TORCH_CHECK(column >= 0 && last < keys.size(3),
                sequence ? "columns " + std::to_string(column) + ".." + std::to_string(last) +
                               " are"
                         : "column " + std::to_string(column) + " is",
                " outside a cache of ", keys.size(3), " columns");
    if (mask && sequence)
        check(*mask, "a sequence's mask", at::kByte, {1, column + rows});
    else if (mask)
        check(*mask, "mask", at::kByte, {rows, column + 1});
    Tensor states = at::empty_like(h);
    const int failed = omni::decode_stack(
        omni::active_variant(), stack->layers.data(), shape, h.data_ptr<float>(), rows,
        cos.data_ptr<float>(), sin.data_ptr<float>(), keys.data_ptr<float>(),
        values.data_ptr<float>(), keys.stride(0), keys.stride(1), keys.stride(2),
        mask ? mask->data_ptr<uint8_t>() : nullptr, column, stack->norm, stack->eps,
        states.data_ptr<float>(), int8, sequence, threads());
    TORCH_CHECK(!failed, "decode_stack: out of memory");
    return states;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(omni_kernels, m) {
    m.class_<DecodeStack>("DecodeStack")
        .def(torch::init<c10::List<std::optional<Tensor>>, std::vector<double>,
                         std::vector<int64_t>>());
    m.def("decode_stack(__torch__.torch.classes.omni_kernels.DecodeStack stack, Tensor(a!) h, "
          "Tensor cos, Tensor sin, Tensor(b!) keys, Tensor(c!) values, Tensor? mask, "
          "int column, bool int8=False, bool sequence=False) -> Tensor",
          &decode_stack);
}
