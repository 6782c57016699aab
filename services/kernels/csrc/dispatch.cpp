/* Which variant runs: the best one this CPU supports, chosen once, on first use
 * (ggml-cpu scores its backend variants the same way). use_variant picks another
 * (OMNI_KERNELS=... at start, and the tests, which run every variant the CPU has). */
#include <atomic>

#include "kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace omni {
namespace {

const Variant *const variants[] = {
#if defined(__x86_64__) && !defined(OMNI_GENERIC_KERNELS)
    &avx512vnni_variant,
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

bool os_saves(uint64_t xcr0_bits) {
#if defined(__x86_64__)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return false;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
    return (xcr0 & xcr0_bits) == xcr0_bits;
#else
    (void)xcr0_bits;
    return false;
#endif
}

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
