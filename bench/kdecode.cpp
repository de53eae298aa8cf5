// One thread's decode matmul (M activation rows) of a k-quant weight on the avx2 path (or, built
// with -DKD_AVX512VNNI, the avx512vnni_t8 path), against a
// plain read of the same bytes: bench/kdecode.py builds it from a csrc/ folder (this checkout's or
// another's, for A/B) and runs it. simd_body.inc's avx2 namespace is compiled alone, with the
// extension's flags, so the kernel is the one the extension runs on an AVX2 CPU (its inlining
// can differ: check the extension's objdump when a change depends on it).
//
//   kdecode QTYPE N K M COPIES REPS PF
//
// QTYPE: ggml's id (12 Q4_K, 13 Q5_K, 14 Q6_K, ...), a [N, K] weight of random valid blocks in
// tiles of 8 rows, COPIES of it (their sum past the L3 streams from DRAM; 1 stays in L2 when it
// fits), huge-page-advised. Each pass runs the matmul over every copy in turn; the best of REPS
// passes in thread CPU time. PF: the fused path's prefetch distance in bytes (0: off). Prints
// cycles per 8-row x 32-value block (a k-quant's: block_bytes(QTYPE) bytes), for the
// kernel and for a read of the same bytes (4 accumulators of 32-byte loads, the kernel's
// software prefetch beside it), the clock (a chain of dependent adds), and a hash of the outputs
// (the same on every variant that computes the same bits).
#include <immintrin.h>
#include <sys/mman.h>
#include <time.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "common.h"
#include "lowbit.h"

namespace tkv {
int64_t g_prefetch = 0;
int64_t g_prefetch_fused[PF_TYPES];   // one distance for every type: PF below
int g_fused_rows = 8;
int g_fused = 1;
int g_pair = 0;
int g_vbmi = 0;
__attribute__((noinline)) Scratch& thread_scratch() {
    static thread_local Scratch s;
    return s;
}
}  // namespace tkv

// -DKD_AVX512VNNI: the avx512vnni_t8 namespace instead (what an AVX-512 VNNI CPU runs below 16 rows)
#ifdef KD_AVX512VNNI
#define TKV_NS avx512vnni_t8
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define TKV_VNNI 1
#define TKV_TILE 8
#define TKV_ZMM 1
#include "simd_body.inc"
namespace kd = avx512vnni_t8;
#else
#define TKV_NS avx2
#define TKV_TARGET __attribute__((target("avx2,fma,f16c")))
#define TKV_VNNI 0
#define TKV_TILE 8
#include "simd_body.inc"
namespace kd = avx2;
#endif

using namespace tkv;

static double thread_ns() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

// cycles per ns: 1000 x 1000 dependent adds, best of 20
static double ghz() {
    double best = 1e30;
    for (int r = 0; r < 20; r++) {
        uint64_t x = 0;
        const double t0 = thread_ns();
        for (int i = 0; i < 1000; i++) {
            __asm__ volatile(".rept 1000\n\tadd $1, %0\n\t.endr" : "+r"(x));
        }
        best = std::min(best, thread_ns() - t0);
    }
    return 1e6 / best;
}

static uint8_t* huge_alloc(size_t n) {
    const size_t a = (size_t)2 << 20;
    n = (n + a - 1) / a * a;
    uint8_t* p = (uint8_t*)std::aligned_alloc(a, n);
    madvise(p, n, MADV_HUGEPAGE);
    return p;
}

// random valid tiles: random bytes, the float16 scales (d, and dmin where the type has one) of
// every block set to small finite values (2^-10 .. 2^-9)
static void fill_weight(uint8_t* w, int qt, int64_t n, int64_t k, std::mt19937_64& rng) {
    const int64_t bytes = n * k / block_elems(qt) * block_bytes(qt);
    for (int64_t i = 0; i < bytes; i += 8) {
        const uint64_t v = rng();
        std::memcpy(w + i, &v, std::min<int64_t>(8, bytes - i));
    }
    const int BB = block_bytes(qt);
    int widths[64];
    const int nf = block_fields(qt, widths);
    for (int64_t b = 0; b < bytes / (8 * BB); b++) {
        uint8_t* blk = w + b * 8 * BB;
        int off = 0;
        for (int f = 0; f < nf; f++) {
            const bool half = widths[f] == 2 && (f < 2 || qt == Q6_K);   // d / dmin (Q6_K: d, its last field)
            if (half)
                for (int r = 0; r < 8; r++) {
                    const uint16_t h = (uint16_t)(0x1400 | (rng() & 0x3FF));
                    std::memcpy(blk + 8 * off + 2 * r, &h, 2);
                }
            off += widths[f];
        }
    }
}

__attribute__((target("avx2"), noinline)) static uint64_t read_pass(const uint8_t* p, int64_t bytes, int64_t pf) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < bytes; i += 128) {
        if (pf > 0) {
            _mm_prefetch((const char*)p + i + pf, _MM_HINT_T1);
            _mm_prefetch((const char*)p + i + pf + 64, _MM_HINT_T1);
        }
        a0 = _mm256_add_epi32(a0, _mm256_load_si256((const __m256i*)(p + i)));
        a1 = _mm256_add_epi32(a1, _mm256_load_si256((const __m256i*)(p + i + 32)));
        a2 = _mm256_add_epi32(a2, _mm256_load_si256((const __m256i*)(p + i + 64)));
        a3 = _mm256_add_epi32(a3, _mm256_load_si256((const __m256i*)(p + i + 96)));
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    return (uint64_t)_mm256_extract_epi64(s, 0) ^ (uint64_t)_mm256_extract_epi64(s, 3);
}

int main(int argc, char** argv) {
    if (argc != 8) {
        std::fprintf(stderr, "usage: kdecode QTYPE N K M COPIES REPS PF\n");
        return 2;
    }
    const int qt = std::atoi(argv[1]), N = std::atoi(argv[2]), K = std::atoi(argv[3]), M = std::atoi(argv[4]);
    const int copies = std::atoi(argv[5]), reps = std::atoi(argv[6]);
    for (int64_t& d : g_prefetch_fused) d = std::atoll(argv[7]);
    const int64_t row_bytes = (int64_t)K / block_elems(qt) * block_bytes(qt);
    const int64_t wbytes = tiled_rows(N) * row_bytes, stride = (wbytes + 4095) / 4096 * 4096;
    uint8_t* w = huge_alloc(stride * copies);
    std::mt19937_64 rng(1234);
    for (int c = 0; c < copies; c++) fill_weight(w + c * stride, qt, tiled_rows(N), K, rng);

    std::vector<float> X((size_t)M * K);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (float& x : X) x = nd(rng);
    std::vector<uint8_t> abuf((size_t)M * K * 2 + (size_t)M * (K / 16) * 40 + 4096);
    Act a;
    a.M = M, a.K = K, a.QB = 32, a.nb = K / 32;
    uint8_t* p = abuf.data();
    auto take = [&](size_t n) { uint8_t* r = p; p += (n + 63) & ~(size_t)63; return r; };
    a.q = (int8_t*)take((size_t)M * K);
    a.d = (float*)take((size_t)M * (K / 32) * 4);
    a.sx = (float*)take((size_t)M * (K / 32) * 4);
    a.bs16 = (int32_t*)take((size_t)M * (K / 16) * 4);
    a.bs32 = (int32_t*)take((size_t)M * (K / 32) * 4);
    a.fb32 = (float*)take((size_t)M * (K / 32) * 4);
    a.bp16 = (int32_t*)take((size_t)M * (K / 32) * 4);
    kd::quantize(X.data(), a, 0, M);

    std::vector<float> Y((size_t)M * N * copies);
    const int64_t ntiles = tiled_rows(N) / 8;
    auto pass = [&]() {
        for (int c = 0; c < copies; c++) {
            Args g{w + c * stride, row_bytes, N, K, M, qt, &a, Y.data() + (size_t)c * M * N, N, nullptr};
            kd::run_tiles(g, 0, ntiles);
        }
    };
    const double hz = ghz();
    const double blocks = (double)copies * ntiles * (K / 32);
    double kbest = 1e30, rbest = 1e30;
    uint64_t sink = 0;
    pass();
    for (int r = 0; r < reps; r++) {   // the kernel and the read alternated
        double t0 = thread_ns();
        pass();
        kbest = std::min(kbest, thread_ns() - t0);
        t0 = thread_ns();
        sink ^= read_pass(w, stride * copies, g_prefetch_fused[0]);
        rbest = std::min(rbest, thread_ns() - t0);
    }
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < Y.size(); i++) {
        uint32_t u;
        std::memcpy(&u, &Y[i], 4);
        h = (h ^ u) * 1099511628211ull;
    }
    const double rbytes = (double)stride * copies, bpb = 8.0 * block_bytes(qt) * 32 / block_elems(qt);
    std::printf("ghz %.3f kernel_cyc %.2f read_cyc %.2f kernel_gbs %.2f read_gbs %.2f hash %016llx sink %llu\n", hz,
                kbest * hz / blocks, rbest * hz / (rbytes / bpb), rbytes / kbest, rbytes / rbest,
                (unsigned long long)h, (unsigned long long)(sink & 1));
    return 0;
}
