// turnkv: Y[M,N] = X[M,K] @ W[N,K]^T with W in GGUF blocks, int8 activations, integer dots.
//
// One binary for every x86 CPU: the SIMD bodies are compiled per ISA with function target
// attributes and picked at run time (__builtin_cpu_supports); a scalar path runs anywhere.
// Every path computes the same bits as turnkv/kernels/reference.py (docs/kernels.md):
// exact int32 block dot products, one fixed float32 formula per block, blocks added in
// order into one accumulator per output. Threads split N (8- or 16-row tiles) only, never K.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdlib>
#include <algorithm>
#include <atomic>
#include <numeric>

#include "common.h"
#include "lowbit.h"
#include "cpu_family.h"
#include "write_attend.h"
#include "row_linear.h"

namespace tkv {

// Software prefetch distance (bytes ahead in the weight stream; 0 = off). Off by default:
// 2048 and 8192 measured no gain over the hardware prefetchers on the Xeon (docs/kernels.md).
int64_t g_prefetch = [] {
    const char* e = std::getenv("TURNKV_KERNEL_PREFETCH");
    return e ? std::atoll(e) : 0;
}();

// The fused paths' prefetch distance per type (common.h prefetch_fused): 8 KB ahead (tuned on a
// Zen 4), but Q8_0 1 KB on AMD family 0x17 (measured on Zen 2: whole one-thread decode steps of the
// 1B Q8_0, Gemma 3's and SmolLM2's Q8_0 heads 2-10% less CPU than at 8 KB, 2% less than none; the
// other types there lose 6-10% without it; docs/measurements/2026-12-07-s24-prefetch.md).
// TURNKV_KERNEL_PREFETCH_FUSED=<bytes> sets every type (A/B), set_prefetch_fused one type in
// process (bench/decode_ab.py); where the prefetches go, never the bits.
static int64_t default_prefetch_fused(int qt) {
    return qt == Q8_0 && tkv_cpu::amd_family() == 0x17 ? 1024 : 8192;
}
int64_t g_prefetch_fused[PF_TYPES];
[[maybe_unused]] static const bool g_prefetch_fused_set = [] {
    const char* e = std::getenv("TURNKV_KERNEL_PREFETCH_FUSED");
    for (int qt = 0; qt < PF_TYPES; qt++) g_prefetch_fused[qt] = e && *e ? std::max(0LL, std::atoll(e)) : default_prefetch_fused(qt);
    return true;
}();
static int64_t set_prefetch_fused(int64_t qt, int64_t bytes) {
    TORCH_CHECK(qt >= 0 && qt < PF_TYPES && bytes >= 0, "set_prefetch_fused: a ggml type id and bytes >= 0");
    const int64_t before = g_prefetch_fused[qt];
    g_prefetch_fused[qt] = bytes;
    return before;
}

// the paired fused path's row limit (common.h FUSED_MAX_ROWS; TURNKV_KERNEL_FUSED_ROWS=8..31 for A/B)
int g_fused_rows = [] {
    const char* e = std::getenv("TURNKV_KERNEL_FUSED_ROWS");
    return e && *e ? std::max(8, std::min(FUSED_MAX_ROWS, std::atoi(e))) : FUSED_MAX_ROWS;
}();
static int64_t set_fused_rows(int64_t n) {
    const int64_t before = g_fused_rows;
    g_fused_rows = (int)std::max<int64_t>(8, std::min<int64_t>(FUSED_MAX_ROWS, n));
    return before;
}

int g_fused = [] {
    const char* e = std::getenv("TURNKV_KERNEL_FUSED");
    return e ? std::atoi(e) : 1;
}();

// The fused decode path (2..8 activation rows) pairs the rows in 512-bit vectors (simd_body.inc,
// fused_pairs): on by default where measured faster (AMD Zen 4 and Zen 5: docs/kernels.md; off on
// Intel until measured there), TURNKV_KERNEL_PAIR=0 / 1 forces it; the same bits either way.
int g_pair = [] {
    const char* e = std::getenv("TURNKV_KERNEL_PAIR");
    return e && *e ? (std::atoi(e) != 0 ? 1 : 0) : (tkv_cpu::amd_zen4_or_later() ? 1 : 0);
}();

// IQ4_XS's fused decode looks its table up with AVX-512 VBMI's vpermb where the CPU has it
// (csrc/iq4xs_fused.inc: no nibble mask); TURNKV_KERNEL_VBMI=0 / set_vbmi turn it off (A/B,
// tests); the same bits either way
static bool cpu_vbmi() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi");
}
int g_vbmi = [] {
    const char* e = std::getenv("TURNKV_KERNEL_VBMI");
    return cpu_vbmi() && !(e && *e && std::atoi(e) == 0) ? 1 : 0;
}();
static int64_t set_vbmi(int64_t on) {
    const int64_t before = g_vbmi;
    g_vbmi = on != 0 && cpu_vbmi() ? 1 : 0;
    return before;
}

// a call goes parallel only when each thread gets at least this many weight-bytes-equivalent
int64_t g_par_bytes = [] {
    const char* e = std::getenv("TURNKV_KERNEL_PAR_BYTES");
    return e ? std::atoll(e) : ((int64_t)256 << 10);
}();

__attribute__((noinline)) Scratch& thread_scratch() {
    static thread_local Scratch s;
    return s;
}

// ------------------------------------------------------------------ scalar path

#include "scalar_path.inc"

// ------------------------------------------------------------------ SIMD paths

// Each AVX-512 path is built twice: 8-row tiles (256-bit vectors) for calls with few rows,
// where they stream the weights faster, and 16-row tiles (512-bit) for many rows. Both do the
// same operations per output, so which one runs never changes a result.
#define TKV_NS avx2
#define TKV_TARGET __attribute__((target("avx2,fma,f16c")))
#define TKV_VNNI 0
#define TKV_TILE 8
#include "simd_body.inc"
#undef TKV_NS
#undef TKV_TARGET
#undef TKV_VNNI
#undef TKV_TILE

#define TKV_NS avx512_t8
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define TKV_VNNI 0
#define TKV_TILE 8
#define TKV_ZMM 1
#include "simd_body.inc"
#undef TKV_NS
#undef TKV_TARGET
#undef TKV_VNNI
#undef TKV_TILE
#undef TKV_ZMM

#define TKV_NS avx512
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define TKV_VNNI 0
#define TKV_TILE 16
#include "simd_body.inc"
#undef TKV_NS
#undef TKV_TARGET
#undef TKV_VNNI
#undef TKV_TILE

#define TKV_NS avx512vnni_t8
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define TKV_VNNI 1
#define TKV_TILE 8
#define TKV_ZMM 1
#include "simd_body.inc"
#undef TKV_NS
#undef TKV_TARGET
#undef TKV_VNNI
#undef TKV_TILE
#undef TKV_ZMM

#define TKV_NS avx512vnni
#define TKV_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define TKV_VNNI 1
#define TKV_TILE 16
#include "simd_body.inc"
#undef TKV_NS
#undef TKV_TARGET
#undef TKV_VNNI
#undef TKV_TILE

// ------------------------------------------------------------------ dispatch

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512VNNI = 3 };

static int detect_isa() {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool f16c = __builtin_cpu_supports("f16c");
    const bool bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (!(avx2 && f16c)) return ISA_SCALAR;
    if (!bw) return ISA_AVX2;
    if (__builtin_cpu_supports("avx512vnni")) return ISA_AVX512VNNI;
    return ISA_AVX512;
}

static int best_isa() {
    static const int isa = detect_isa();
    return isa;
}

using RunFn = void (*)(const Args&, int64_t, int64_t);
using QuantFn = void (*)(const float*, const Act&, int, int);

// [isa][wide]: wide = 16-row tiles, used from WIDE_MIN_ROWS rows on (AVX-512 paths)
static const RunFn kRun[][2] = {{scalar::run_tiles, scalar::run_tiles},
                                {avx2::run_tiles, avx2::run_tiles},
                                {avx512_t8::run_tiles, avx512::run_tiles},
                                {avx512vnni_t8::run_tiles, avx512vnni::run_tiles}};
static const int kTile[][2] = {{TILE, TILE}, {8, 8}, {8, 16}, {8, 16}};
constexpr int64_t WIDE_MIN_ROWS = 16;
static const QuantFn kQuant[] = {scalar::quantize, avx2::quantize, avx512::quantize, avx512vnni::quantize};

// The activation arrays of M rows of K values (pair: the paired path's too) carved from buf, grown
// as needed; the layout quantize_act gives (the kernels read only the pointers).
static bool wants_pair(int isa, int64_t M) { return M >= 2 && M <= fused_rows_for(isa) && isa >= 2 && g_pair; }
static void act_layout(std::vector<uint8_t>& buf, int64_t M, int64_t K, bool pair, Act& a) {
    a.M = (int)M;
    a.K = (int)K;
    a.QB = 32;  // 32-value activation blocks for every type (the k-quants too; docs/kernels.md)
    a.nb = (int)(K / 32);
    const size_t nq = (size_t)M * K, n32 = (size_t)M * (K / 32), n16 = (size_t)M * (K / 16);
    const size_t need = nq + 64 + 2 * (n32 * 4 + 64) + (n16 * 4 + 64) + 3 * (n32 * 4 + 64) +
                        (pair ? nq + 64 + 3 * (n32 * 4 + 64) + (n16 * 4 + 64) : 0);
    if (buf.size() < need) buf.resize(need);
    uint8_t* p = buf.data();
    auto take = [&](size_t n) { uint8_t* r = p; p += (n + 63) & ~(size_t)63; return r; };
    a.q = (int8_t*)take(nq);
    a.d = (float*)take(n32 * 4);
    a.sx = (float*)take(n32 * 4);
    a.bs16 = (int32_t*)take(n16 * 4);
    a.bs32 = (int32_t*)take(n32 * 4);
    a.fb32 = (float*)take(n32 * 4);
    a.bp16 = (int32_t*)take(n32 * 4);
    a.q16 = nullptr;
    a.q2 = nullptr;
    a.d2 = a.sx2 = nullptr;
    a.b2 = a.b16_2 = nullptr;
    if (pair) {
        a.q2 = (int32_t*)take(nq);
        a.d2 = (float*)take(n32 * 4);
        a.sx2 = (float*)take(n32 * 4);
        a.b2 = (int32_t*)take(n32 * 4);
        a.b16_2 = (int32_t*)take(n16 * 4);
    }
}

// a's rows quantized from X (each row alone: quantize_rows)
static void act_fill(const float* X, int isa, const Act& a) {
    const QuantFn qf = kQuant[isa];
    if (a.M >= 16) {
        at::parallel_for(0, a.M, 4, [&](int64_t b, int64_t e) { qf(X, a, (int)b, (int)e); });
    } else {
        qf(X, a, 0, a.M);
    }
}

// row `from` of s into row `to` of d (the same K, no pairing): the bits quantizing the row there gives
static void act_copy_row(const Act& s, int64_t from, const Act& d, int64_t to) {
    const int64_t K = s.K, n32 = K / 32, n16 = K / 16;
    std::memcpy(d.q + to * K, s.q + from * K, (size_t)K);
    std::memcpy(d.d + to * n32, s.d + from * n32, (size_t)n32 * 4);
    std::memcpy(d.sx + to * n32, s.sx + from * n32, (size_t)n32 * 4);
    std::memcpy(d.bs16 + to * n16, s.bs16 + from * n16, (size_t)n16 * 4);
    std::memcpy(d.bs32 + to * n32, s.bs32 + from * n32, (size_t)n32 * 4);
    std::memcpy(d.fb32 + to * n32, s.fb32 + from * n32, (size_t)n32 * 4);
    std::memcpy(d.bp16 + to * n32, s.bp16 + from * n32, (size_t)n32 * 4);
}

// The paired path's arrays of a (act_layout with pair) from its rows: rows 2p and 2p+1 side by
// side (an odd last row is not paired)
static void pair_rows(const Act& a) {
    const int64_t K = a.K, M = a.M;
    const int64_t G = K / 4, nb = a.nb;
    for (int64_t p = 0; p < M / 2; p++) {
        const int32_t* r0 = (const int32_t*)(a.q + (2 * p) * K);
        const int32_t* r1 = (const int32_t*)(a.q + (2 * p + 1) * K);
        int32_t* o = a.q2 + p * G * 2;
        for (int64_t g = 0; g < G; g++) {
            o[2 * g] = r0[g];
            o[2 * g + 1] = r1[g];
        }
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < 2; i++) {
                const int64_t src = (2 * p + i) * nb + b, dst = (p * nb + b) * 2 + i;
                a.d2[dst] = a.d[src];
                a.sx2[dst] = a.sx[src];
                a.b2[dst] = a.bs32[src];
            }
        for (int64_t j = 0; j < K / 16; j++)
            for (int i = 0; i < 2; i++) a.b16_2[(p * (K / 16) + j) * 2 + i] = a.bs16[(2 * p + i) * (K / 16) + j];
    }
}

// Quantize X [M, K] (contiguous float32) into the calling thread's activation buffer.
static void quantize_act(const float* X, int64_t M, int64_t K, int isa, Act& a) {
    static thread_local std::vector<uint8_t> abuf;
    const bool pair = wants_pair(isa, M);  // the paired path's layout (AVX-512)
    act_layout(abuf, M, K, pair, a);
    act_fill(X, isa, a);
    if (pair) pair_rows(a);
}

// avx2 calls of Q8_0 / IQ4_XS past 8 rows read the activations as int16 (csrc/simd_body.inc
// chunk_dot16): widened here once for all threads (each thread's own copy of 8 MB at K = 8192
// would crowd the L3), into the calling thread's buffer, valid until its next call
static bool wants16(int isa, int qt, int64_t M) { return isa == ISA_AVX2 && M > 8 && (qt == Q8_0 || qt == IQ4_XS); }
static void widen_act(Act& a) {
    static thread_local std::vector<int16_t> buf;
    const size_t n = (size_t)a.M * a.K;
    if (buf.size() < n) buf.resize(n);
    int16_t* const o = buf.data();
    if (a.M >= 16) at::parallel_for(0, a.M, 4, [&](int64_t b, int64_t e) { avx2::widen16(a, o, (int)b, (int)e); });
    else avx2::widen16(a, o, 0, a.M);
    a.q16 = o;
}

// the paired path on / off (tests, A/B); returns the previous setting
static int64_t set_pair(int64_t on) {
    const int64_t before = g_pair;
    g_pair = on != 0 ? 1 : 0;
    return before;
}

// the most parts (weights stacked along the output rows) one call takes
constexpr int MAX_PARTS = 8;

// One weight of a stacked matmul: W [N, K] in GGUF blocks (tiles of 8 rows), its output columns
// Y[:, 0:N] (row stride ldy of run_parts). `a`: this part's own activations (the same M as
// run_parts' own) where they differ from the call's: a MoE row's down projections, one
// activation row an expert, in one region.
struct Part {
    const uint8_t* W;
    int64_t row_bytes;
    int qt;
    int64_t N;
    float* Y;
    const Act* a = nullptr;
};

// A region's parts laid out by work (a tile's weight bytes times 1 + M/4 for the dot products):
// part i's tiles start at work w0[i], each tw[i] long; `run(lo, hi)` computes the tiles whose
// first work unit lies in [lo, hi) (the parts side by side), telling each part's range where the
// next part's starts (Args::next: the kernels prefetch it; null after the last).
struct Region {
    Args g[MAX_PARTS];
    int64_t ntiles[MAX_PARTS], tw[MAX_PARTS], w0[MAX_PARTS + 1];
    int np = 0, tile = 0;
    RunFn rf = nullptr;

    int64_t first_at(int i, int64_t w) const {   // the first tile of part i starting at or after w
        const int64_t off = w - w0[i];
        return off <= 0 ? 0 : std::min<int64_t>(ntiles[i], (off + tw[i] - 1) / tw[i]);
    }
    void run(int64_t lo, int64_t hi) const {
        int64_t b[MAX_PARTS], e[MAX_PARTS];
        for (int i = 0; i < np; i++) {
            b[i] = first_at(i, lo);
            e[i] = first_at(i, hi);
        }
        for (int i = 0, j; i < np; i = j) {
            for (j = i + 1; j < np && b[j] >= e[j]; j++) {}
            if (b[i] >= e[i]) continue;
            Args gi = g[i];
            gi.next = j < np ? g[j].W + b[j] * tile * g[j].row_bytes : nullptr;
            rf(gi, b[i], e[i]);
        }
    }
};

// Y = the quantized activations a times every part, in one parallel region: the parts' output
// tiles side by side, cut into one contiguous range a thread by their work, so a small part in its
// own quantization type (Gemma 3's v rows) is shared like the rest instead of running alone on the
// calling thread. A call goes parallel once its work passes ~256 KB (TURNKV_KERNEL_PAR_BYTES), on
// one thread per started 256 KB (at most the pool's): smaller calls stay on the calling thread,
// where a parallel region's wake-up and barrier would cost more than the work. Which thread
// computes a tile changes none of its bits.
static void run_parts(const Act& a, const Part* parts, int np, int isa, int64_t ldy) {
    TORCH_CHECK(np >= 1 && np <= MAX_PARTS, "run_parts: 1..", MAX_PARTS, " parts");
    const int64_t M = a.M;
    const int wide = M >= WIDE_MIN_ROWS && M > fused_rows_for(isa) ? 1 : 0;
    Region R;
    R.np = np;
    R.tile = kTile[isa][wide];
    R.rf = kRun[isa][wide];
    R.w0[0] = 0;
    for (int i = 0; i < np; i++) {
        Args& g = R.g[i];
        g.W = parts[i].W;
        g.row_bytes = parts[i].row_bytes;
        g.N = (int)parts[i].N;
        g.K = a.K;
        g.M = (int)M;
        g.qt = parts[i].qt;
        g.a = parts[i].a ? parts[i].a : &a;
        TORCH_CHECK(g.a->M == M && g.a->K == a.K, "run_parts: a part's own activations must have the call's shape");
        g.Y = parts[i].Y;
        g.ldy = ldy;
        R.ntiles[i] = (parts[i].N + R.tile - 1) / R.tile;
        R.tw[i] = std::max<int64_t>(1, R.tile * parts[i].row_bytes * (1 + M / 4));
        R.w0[i + 1] = R.w0[i] + R.ntiles[i] * R.tw[i];
    }
    const int64_t work = R.w0[np];
    const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                               (work + g_par_bytes - 1) / std::max<int64_t>(1, g_par_bytes)));
    if (nth == 1) {
        R.run(0, work);
        return;
    }
    // thread t: the tiles whose first work unit lies in [work * t / nth, work * (t + 1) / nth)
    at::parallel_for(0, nth, 1, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; t++) R.run(work * t / nth, work * (t + 1) / nth);
    });
}

#include "float_matmul.inc"

static torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor w, int64_t qt, int64_t N, int64_t K, int64_t isa) {
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gguf_matmul: CPU tensors only");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) == K,
                "gguf_matmul: x must be contiguous float32 [M, K]");
    TORCH_CHECK(isa >= 0 && isa <= best_isa(), "gguf_matmul: ISA path ", isa, " not supported by this CPU");
    if (is_float_w((int)qt)) {
        TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(0) == tiled_rows(N) &&
                        w.size(1) == 2 * K,
                    "gguf_matmul: w must be contiguous uint8 tiles of 8 rows [ceil(N / 8) * 8, 2 K]");
        return float_matmul(x, w, (int)qt, N, K, (int)isa);
    }
    const int bb = block_bytes((int)qt), be = block_elems((int)qt);
    TORCH_CHECK(bb > 0, "gguf_matmul: unsupported quantization type ", qt);
    TORCH_CHECK(K % be == 0, "gguf_matmul: K not a multiple of the block size");
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
                    w.size(0) == tiled_rows(N) && w.size(1) == K / be * bb,
                "gguf_matmul: w must be contiguous uint8 tiles of 8 rows [ceil(N / 8) * 8, row_bytes]");
    TORCH_CHECK(isa >= 0 && isa <= best_isa(), "gguf_matmul: ISA path ", isa, " not supported by this CPU");
    const int64_t M = x.size(0);
    auto y = torch::empty({M, N}, torch::kFloat32);
    if (M == 0 || N == 0) return y;
    Act a;
    quantize_act(x.data_ptr<float>(), M, K, (int)isa, a);
    if (wants16((int)isa, (int)qt, M)) widen_act(a);
    const Part part{w.data_ptr<uint8_t>(), w.size(1), (int)qt, N, y.data_ptr<float>()};
    run_parts(a, &part, 1, (int)isa, N);
    return y;
}

#include "fused_layer.inc"
#include "moe_experts.inc"
#include "norm_head.inc"
#include "tile_gather.inc"
#include "row_dequant.inc"

}  // namespace tkv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "turnkv GGUF int8-activation matmul kernels";
    // the GIL is released while the kernel runs (other Python threads, e.g. the server's, go on)
    m.def("gguf_matmul", &tkv::gguf_matmul, "Y = X @ W^T, W in GGUF blocks", py::arg("x"), py::arg("w"), py::arg("qtype"),
          py::arg("n"), py::arg("k"), py::arg("isa"), py::call_guard<py::gil_scoped_release>());
    m.def("set_pair", &tkv::set_pair, "the fused path's paired 512-bit rows on (1) / off (0); returns the previous", py::arg("on"));
    m.def("set_fused_rows", &tkv::set_fused_rows, "the fused decode path's row limit (8..31; tests, A/B); returns the previous", py::arg("n"));
    m.def("set_prefetch_fused", &tkv::set_prefetch_fused,
          "the fused paths' prefetch distance (bytes ahead, 0 = off) of one ggml type id; returns the previous",
          py::arg("qtype"), py::arg("bytes"));
    m.def("pair", [] { return (int64_t)tkv::g_pair; }, "1 when the fused path pairs rows in 512-bit vectors");
    m.def("set_vbmi", &tkv::set_vbmi, "IQ4_XS's vpermb lookup on (1, where the CPU has AVX-512 VBMI) / off (0); returns the previous", py::arg("on"));
    m.def("best_isa", &tkv::best_isa, "best ISA path: 0 scalar, 1 avx2, 2 avx512, 3 avx512vnni");
    m.def("tile_gather", &tkv::tile_gather,
          "per job: out[t, j] = rows[t, index[j]] per tile of 1- or 2-byte units; every job in one parallel region (the load's repack)",
          py::arg("src"), py::arg("index"), py::arg("out"), py::arg("unit_bytes"), py::arg("order"),
          py::arg("parallel") = true, py::call_guard<py::gil_scoped_release>());
    m.def("dequant_rows", &tkv::dequant_rows, "rows ids of a tiled Q4_K / Q5_K / Q6_K weight as float32 (gguf-py's bits)",
          py::arg("w"), py::arg("qtype"), py::arg("ids"), py::arg("n"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
    tkv::register_fused(m);
    tkv::register_moe(m);
    tkv::register_head(m);
    m.def("write_attend", &tkv_attn::write_attend,
          "one layer's K/V cache writes and attention for a batch of spans (csrc/attention.cpp)", py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("kbufs"), py::arg("vbufs"), py::arg("lens"), py::arg("tables"),
          py::arg("q_pos0"), py::arg("k_pos0"), py::arg("kind"), py::arg("wc"), py::arg("scale"),
          py::arg("softcap"), py::arg("isa"), py::arg("sinks") = py::none(), py::arg("kscales") = py::none(), py::arg("vscales") = py::none(),
          py::arg("out") = py::none(), py::arg("keep") = py::none(),
          py::call_guard<py::gil_scoped_release>());
}
