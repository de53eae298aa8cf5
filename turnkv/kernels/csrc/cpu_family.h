// turnkv: the CPU's AMD family, for defaults measured per CPU kind (included by gguf_matmul.cpp
// and attention.cpp; docs/kernels.md says which default was measured where).
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tkv_cpu {

// The AMD family (0x19 Zen 3/4, 0x1A Zen 5), or 0 on any other vendor or architecture.
inline unsigned amd_family() {
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;   // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xf;
    return base == 0xf ? base + ((a >> 20) & 0xff) : base;
#else
    return 0;
#endif
}

// An AMD Zen 4 or later: family 0x1A and up, or 0x19 with AVX-512 (Zen 3, also 0x19, has none).
// The defaults measured on both Zen 4 and Zen 5 key on this.
inline bool amd_zen4_or_later() {
    const unsigned f = amd_family();
#if defined(__x86_64__)
    __builtin_cpu_init();   // callers run as static initializers, maybe before libgcc's own
    return f >= 0x1a || (f == 0x19 && __builtin_cpu_supports("avx512f"));
#else
    return false;
#endif
}

}  // namespace tkv_cpu
