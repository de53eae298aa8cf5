// What one core of this machine can issue, for reading kernel timings against (bench/roofline.py
// builds and runs it). Each loop keeps 12 independent accumulators, enough to hide the
// instruction's latency, in named registers (an array of accumulators can end up in memory, a
// load and a store per step, which measures the store-forwarding path instead).
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstdio>

#define ACC12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx2,fma"), noinline)) static float fma_loop(int64_t iters) {
    __m256 q = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.5f);
#define DECL(i) __m256 a##i = _mm256_set1_ps((float)i);
    ACC12(DECL)
#undef DECL
    for (int64_t it = 0; it < iters; it++) {
#define STEP(i) a##i = _mm256_fmadd_ps(q, b, a##i);
        ACC12(STEP)
#undef STEP
        __asm__ volatile("" : "+x"(q));
    }
    __m256 s = _mm256_setzero_ps();
#define SUM(i) s = _mm256_add_ps(s, a##i);
    ACC12(SUM)
#undef SUM
    return _mm256_cvtss_f32(s);
}

// vpmaddubsw + vpaddw: the int8 dot step of the GGUF kernels without VNNI (32 multiply-adds each)
// in assembly: the compiler keeps so many vector accumulators partly on the stack
__attribute__((target("avx2"), noinline)) static void int8_loop(int64_t iters) {
    __asm__ volatile(
        "vpxor %%xmm12, %%xmm12, %%xmm12\n\t" "vpxor %%xmm13, %%xmm13, %%xmm13\n\t"
        "1:\n\t"
        "vpmaddubsw %%ymm13, %%ymm12, %%ymm14\n\t" "vpaddw %%ymm14, %%ymm0, %%ymm0\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm1, %%ymm1\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm14\n\t" "vpaddw %%ymm14, %%ymm2, %%ymm2\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm3, %%ymm3\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm14\n\t" "vpaddw %%ymm14, %%ymm4, %%ymm4\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm5, %%ymm5\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm14\n\t" "vpaddw %%ymm14, %%ymm6, %%ymm6\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm7, %%ymm7\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm14\n\t" "vpaddw %%ymm14, %%ymm8, %%ymm8\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm9, %%ymm9\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm14\n\t" "vpaddw %%ymm14, %%ymm10, %%ymm10\n\t"
                     "vpmaddubsw %%ymm13, %%ymm12, %%ymm15\n\t" "vpaddw %%ymm15, %%ymm11, %%ymm11\n\t"
                     "dec %0\n\t"
        "jnz 1b\n\t"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "xmm15", "cc");
}

// the same two steps 512 bits wide, and vpdpbusd (AVX-512 VNNI: 64 multiply-adds in one instruction),
// for the avx512 / avx512vnni paths
__attribute__((target("avx512f"), noinline)) static float fma_zmm_loop(int64_t iters) {
    __m512 q = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.5f);
#define DECL(i) __m512 a##i = _mm512_set1_ps((float)i);
    ACC12(DECL)
#undef DECL
    for (int64_t it = 0; it < iters; it++) {
#define STEP(i) a##i = _mm512_fmadd_ps(q, b, a##i);
        ACC12(STEP)
#undef STEP
        __asm__ volatile("" : "+v"(q));
    }
    __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
    ACC12(SUM)
#undef SUM
    return _mm512_reduce_add_ps(s);
}

#define ZCLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc"
#define ZPAIR(a, t) "vpmaddubsw %%zmm13, %%zmm12, %%zmm" #t "\n\t" "vpaddw %%zmm" #t ", %%zmm" #a ", %%zmm" #a "\n\t"
__attribute__((target("avx512f,avx512bw"), noinline)) static void int8_zmm_loop(int64_t iters) {
    __asm__ volatile(
        "vpxord %%zmm12, %%zmm12, %%zmm12\n\t" "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
        "1:\n\t"
        ZPAIR(0, 14) ZPAIR(1, 15) ZPAIR(2, 14) ZPAIR(3, 15) ZPAIR(4, 14) ZPAIR(5, 15)
        ZPAIR(6, 14) ZPAIR(7, 15) ZPAIR(8, 14) ZPAIR(9, 15) ZPAIR(10, 14) ZPAIR(11, 15)
        "dec %0\n\t"
        "jnz 1b\n\t"
        : "+r"(iters) : : ZCLOBBER);
}

#define ZDOT(a) "vpdpbusd %%zmm13, %%zmm12, %%zmm" #a "\n\t"
__attribute__((target("avx512f,avx512vnni"), noinline)) static void vnni_zmm_loop(int64_t iters) {
    __asm__ volatile(
        "vpxord %%zmm12, %%zmm12, %%zmm12\n\t" "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
        "1:\n\t"
        ZDOT(0) ZDOT(1) ZDOT(2) ZDOT(3) ZDOT(4) ZDOT(5) ZDOT(6) ZDOT(7) ZDOT(8) ZDOT(9) ZDOT(10) ZDOT(11)
        "dec %0\n\t"
        "jnz 1b\n\t"
        : "+r"(iters) : : ZCLOBBER);
}

template <class F>
static double best_ns_per_op(F f, int64_t ops) {
    double best = 1e30;
    for (int r = 0; r < 9; r++) {
        auto t0 = std::chrono::steady_clock::now();
        f();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (s < best) best = s;
    }
    return best * 1e9 / (double)ops;
}

int main() {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        std::printf("no AVX2 + FMA on this CPU\n");
        return 1;
    }
    const int64_t n = 10000000;
    volatile float sf = 0.f;
    const double fma = best_ns_per_op([&] { sf = fma_loop(n); }, 12 * n);
    const double i8 = best_ns_per_op([&] { int8_loop(n); }, 12 * n);
    std::printf("fma_ymm_per_ns %.3f\n", 1.0 / fma);
    std::printf("maddubs_ymm_per_ns %.3f\n", 1.0 / i8);
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        const double fz = best_ns_per_op([&] { sf = fma_zmm_loop(n); }, 12 * n);
        const double iz = best_ns_per_op([&] { int8_zmm_loop(n); }, 12 * n);
        std::printf("fma_zmm_per_ns %.3f\nmaddubs_zmm_per_ns %.3f\n", 1.0 / fz, 1.0 / iz);
        if (__builtin_cpu_supports("avx512vnni")) {
            const double dz = best_ns_per_op([&] { vnni_zmm_loop(n); }, 12 * n);
            std::printf("dpbusd_zmm_per_ns %.3f\n", 1.0 / dz);
        }
    }
    // the cost of an OpenMP parallel region and of a barrier inside one, all threads spinning
    const int N = 50000;
    volatile int sink = 0;
    const double region = best_ns_per_op([&] {
        for (int i = 0; i < N; i++) {
#pragma omp parallel
            { sink = sink + omp_get_thread_num(); }
        }
    }, N);
    const double barrier = best_ns_per_op([&] {
#pragma omp parallel
        {
            for (int i = 0; i < N; i++) {
#pragma omp barrier
            }
        }
    }, N);
    std::printf("omp_threads %d\nomp_region_us %.3f\nomp_barrier_us %.3f\n", omp_get_max_threads(), region / 1e3, barrier / 1e3);
    return 0;
}
