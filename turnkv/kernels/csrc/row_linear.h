// turnkv: Y[M, N] = X[M, K] @ W[N, K]^T for small float32 matrices (MoE routers, low-rank
// projections) in one fixed order per output, so a row's result never depends on the rows
// beside it (a float GEMM's blocking rounds a row by its neighbours: another expert picked).
//
// y[m, n]: 16 lane sums s[l] = chain over k = l, l + 16, l + 32, ... of (s[l] + x[m, k] * w[n, k])
// (a multiply, then an add: no fused multiply-add; a last partial group adds zero products), then
// the fixed tree s[l] += s[l + 8], s[l] += s[l + 4], s[l] += s[l + 2], y = s[0] + s[1]. The same on
// the scalar, AVX2 (two 8-lane halves) and AVX-512 paths and in kernels/row_linear.py's PyTorch
// reference, so also the same on every CPU. Shared by row_linear.cpp's op and moe_experts.inc.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace tkv_rl {

constexpr int64_t LANES = 16;

static inline float tree16(float* s) {
    for (int h = 8; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) s[l] = s[l] + s[l + h];
    return s[0];
}

static void rows_scalar(const float* X, int64_t K, const float* W, int64_t N, float* Y, int64_t m0, int64_t m1,
                        int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; m++)
        for (int64_t n = n0; n < n1; n++) {
            const float *x = X + m * K, *w = W + n * K;
            float s[LANES] = {};
            for (int64_t k = 0; k < K; k += LANES)
                for (int64_t l = 0; l < LANES && k + l < K; l++) s[l] = s[l] + x[k + l] * w[k + l];
            Y[m * N + n] = tree16(s);
        }
}

#define TKV_RL_AVX2 __attribute__((target("avx2")))
#define TKV_RL_AVX512 __attribute__((target("avx512f")))

// the tree from the 8 sums s[l] + s[l + 8]
TKV_RL_AVX2 static inline float tree8(__m256 s8) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// MR rows from m times NR outputs from n: MR * NR independent chains of 16 lanes
template <int MR, int NR>
TKV_RL_AVX512 static void tile512(const float* X, int64_t K, const float* W, int64_t N, float* Y, int64_t m, int64_t n) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        const __mmask16 mask = K - k >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        __m512 w[NR];
        for (int j = 0; j < NR; j++) w[j] = _mm512_maskz_loadu_ps(mask, W + (n + j) * K + k);
        for (int i = 0; i < MR; i++) {
            const __m512 x = _mm512_maskz_loadu_ps(mask, X + (m + i) * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_mul_ps(x, w[j]));
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            const __m512 v = acc[i][j];
            const __m256 lo = _mm512_castps512_ps256(v);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            Y[(m + i) * N + n + j] = tree8(_mm256_add_ps(lo, hi));
        }
}

// the same with each 16-lane sum as two 8-lane halves
template <int MR, int NR>
TKV_RL_AVX2 static void tile256(const float* X, int64_t K, const float* W, int64_t N, float* Y, int64_t m, int64_t n) {
    __m256 lo[MR][NR], hi[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    alignas(32) float xt[MR][LANES], wt[NR][LANES];
    for (int64_t k = 0; k < K; k += LANES) {
        const int64_t r = std::min<int64_t>(LANES, K - k);
        const float *xs[MR], *ws[NR];
        for (int i = 0; i < MR; i++) xs[i] = X + (m + i) * K + k;
        for (int j = 0; j < NR; j++) ws[j] = W + (n + j) * K + k;
        if (r < LANES) {   // the last partial group, zero-padded
            for (int i = 0; i < MR; i++) {
                for (int64_t l = 0; l < LANES; l++) xt[i][l] = l < r ? xs[i][l] : 0.f;
                xs[i] = xt[i];
            }
            for (int j = 0; j < NR; j++) {
                for (int64_t l = 0; l < LANES; l++) wt[j][l] = l < r ? ws[j][l] : 0.f;
                ws[j] = wt[j];
            }
        }
        __m256 wl[NR], wh[NR];
        for (int j = 0; j < NR; j++) {
            wl[j] = _mm256_loadu_ps(ws[j]);
            wh[j] = _mm256_loadu_ps(ws[j] + 8);
        }
        for (int i = 0; i < MR; i++) {
            const __m256 xl = _mm256_loadu_ps(xs[i]), xh = _mm256_loadu_ps(xs[i] + 8);
            for (int j = 0; j < NR; j++) {
                lo[i][j] = _mm256_add_ps(lo[i][j], _mm256_mul_ps(xl, wl[j]));
                hi[i][j] = _mm256_add_ps(hi[i][j], _mm256_mul_ps(xh, wh[j]));
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) Y[(m + i) * N + n + j] = tree8(_mm256_add_ps(lo[i][j], hi[i][j]));
}

// rows m0..m1 of Y: tiles of 4 rows x 4 outputs (AVX-512: 16 of the 32 registers accumulate) or
// 1 x 4 (AVX2, 16 registers), then the edges
template <bool WIDE>
static void rows_simd(const float* X, int64_t K, const float* W, int64_t N, float* Y, int64_t m0, int64_t m1,
                      int64_t n0, int64_t n1) {
    constexpr int MR = WIDE ? 4 : 1;
    auto tile = [&](auto mr, auto nr, int64_t m, int64_t n) {
        if constexpr (WIDE) tile512<decltype(mr)::value, decltype(nr)::value>(X, K, W, N, Y, m, n);
        else tile256<decltype(mr)::value, decltype(nr)::value>(X, K, W, N, Y, m, n);
    };
    using one = std::integral_constant<int, 1>;
    using four = std::integral_constant<int, 4>;
    using mrc = std::integral_constant<int, MR>;
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) tile(mrc{}, four{}, m, n);
        for (; n < n1; n++) tile(mrc{}, one{}, m, n);
    }
    for (; m < m1; m++) {
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) tile(one{}, four{}, m, n);
        for (; n < n1; n++) tile(one{}, one{}, m, n);
    }
}

// the widest path this CPU runs (the GGUF kernels' numbering, AVX-512 as 2)
static inline int best_isa() { return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0; }

// isa as the GGUF kernels number it: 0 scalar, 1 AVX2, 2 and up AVX-512. A call larger than a
// decode step's splits its rows over the threads; a decode step's few rows past ~512 KB of weights
// (a MoE router: 1 MB of float32 for 128 experts x 2048) split their outputs instead, in runs of
// 4, where the call ran on one thread while the others waited (docs/kernels.md). Each output's
// order is the same whichever thread computes it, so the same bits either way.
static void row_linear(const float* X, int64_t M, int64_t K, const float* W, int64_t N, float* Y, int isa) {
    auto run = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
        if (isa >= 2) rows_simd<true>(X, K, W, N, Y, m0, m1, n0, n1);
        else if (isa == 1) rows_simd<false>(X, K, W, N, Y, m0, m1, n0, n1);
        else rows_scalar(X, K, W, N, Y, m0, m1, n0, n1);
    };
    if (M * N * K <= ((int64_t)1 << 21)) {
        const int64_t nth = std::min<int64_t>(at::get_num_threads(), (N + 3) / 4);
        if (N * K < ((int64_t)1 << 17) || nth < 2 || at::in_parallel_region()) {
            run(0, M, 0, N);
            return;
        }
        const int64_t per = ((N + nth - 1) / nth + 3) / 4 * 4;
        at::parallel_for(0, nth, 1, [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; t++) run(0, M, std::min(N, t * per), std::min(N, (t + 1) * per));
        });
        return;
    }
    // a thread's rows pass over the outputs a block at a time, each block's weights (~128 KB) read
    // from L2 by every row (a prefill chunk's router read all of its 1 MB from L3 once a row)
    const int64_t grain = std::max<int64_t>(4, ((int64_t)1 << 20) / std::max<int64_t>(1, N * K) / 4 * 4);
    const int64_t nb = std::max<int64_t>(4, ((int64_t)1 << 15) / std::max<int64_t>(1, K) / 4 * 4);
    at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
        for (int64_t n0 = 0; n0 < N; n0 += nb) run(b, e, n0, std::min(N, n0 + nb));
    });
}

#undef TKV_RL_AVX2
#undef TKV_RL_AVX512

}  // namespace tkv_rl
