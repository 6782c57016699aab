/* Which variant runs: the best one this CPU supports, chosen once, on first use
 * (ggml-cpu scores its backend variants the same way). use_variant picks another
 * (OMNI_KERNELS=... at start, and the tests, which run every variant the CPU has). */
#include <atomic>

#include "kernels.h"

namespace omni {
namespace {

const Variant *const variants[] = {
#if defined(__x86_64__) && !defined(OMNI_GENERIC_KERNELS)
    &avx512_variant,
    &avx2_variant,
#endif
    &reference_variant,
};
constexpr int64_t count = sizeof variants / sizeof variants[0];

const Variant *best() {
    for (const Variant *v : variants)
        if (v->supported()) return v;
    return &reference_variant;
}

std::atomic<const Variant *> active{nullptr};

}  // namespace

const Variant *const *all_variants(int64_t *n) {
    *n = count;
    return variants;
}

const Variant &active_variant() {
    const Variant *v = active.load(std::memory_order_acquire);
    if (!v) {
        v = best();
        active.store(v, std::memory_order_release);
    }
    return *v;
}

const char *use_variant(const char *name) {
    for (const Variant *v : variants) {
        if (std::strcmp(v->name, name)) continue;
        if (!v->supported()) return "this CPU lacks the instruction sets it needs";
        active.store(v, std::memory_order_release);
        return nullptr;
    }
    return "this build has no such variant";
}

}  // namespace omni
