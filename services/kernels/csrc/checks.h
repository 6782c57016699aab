/* The argument checks every op makes before it takes a pointer (ops.cpp). */
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "kernels.h"

namespace omni::ops {

using at::Tensor;

int threads(); /* torch's intra-op threads: the kernels share its pool */
/* t on the CPU, of dtype and shape, contiguous; else a RuntimeError naming it. */
void check(const Tensor &t, const char *name, at::ScalarType dtype, at::IntArrayRef shape);
void check_2d(const Tensor &t, const char *name); /* float32, 2-D, contiguous */
BlockWeight block_weight(const Tensor &qs, const Tensor &d, const std::optional<Tensor> &m,
                         const std::optional<Tensor> &bias, const std::string &name,
                         const std::optional<Tensor> &packed);
void check_cache(const Tensor &keys, const Tensor &values, int64_t dims);

}  // namespace omni::ops
